"""Routing strategies: given the Ready replicas and a request's routing key, pick one.

A strategy is a small object behind the `Picker` protocol (as SGLang's router policies and
llm-d's scorers are), so a new one plugs in without touching the proxy or the activator: it
names itself and declares what it needs (routing keys, hence a tokenizer; warm-up of new
engines), and `PICKERS` lists it. `prefix-aware` is the default; `least-load` and
`round-robin` are the baselines.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar, Mapping, Protocol, Sequence

from .engine_views import EngineViews
from .flags import STRATEGIES, routing_flag
from .routing_key import RoutingKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    url: str
    reason: str  # why this replica: a label of kubeinfer:router_decisions_total
    predicted_cached_tokens: int = 0
    held_off_warming: bool = False   # a replica being warmed with this prefix was passed over


class Picker(Protocol):
    """Chooses among `urls` (Ready, non-empty, in a stable order); `in_flight` is this router's
    count of requests per replica. Called on the event loop: must not block."""

    strategy: ClassVar[str]   # its `--strategy` name (`flags.STRATEGIES`)
    keyed: ClassVar[bool]     # reads routing keys: the router tokenizes prompts for it
    warms: ClassVar[bool]     # new engines get the hot prefixes first (the keys' prefixes)

    def pick(self, urls: Sequence[str], key: RoutingKey | None, in_flight: Mapping[str, int]) -> Decision: ...

    def release(self, url: str, key: RoutingKey | None) -> None:
        """The request picked for `url` has ended (answered, failed or abandoned)."""

    @classmethod
    def create(cls, views: EngineViews | None, config: PrefixAwareConfig) -> Picker:
        """The picker `--strategy` names, from the engines' views and the balance knobs."""


def rendezvous(affinity: int, url: str) -> int:
    """Highest-random-weight rank of `url` for `affinity`: the same on every router, and a
    replica joining or leaving moves only the keys it wins or held."""
    digest = hashlib.blake2b(affinity.to_bytes(8, "little") + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class RoundRobin:
    strategy, keyed, warms = "round-robin", False, False

    def __init__(self) -> None:
        self._turn = itertools.count()

    @classmethod
    def create(cls, views: EngineViews | None, config: PrefixAwareConfig) -> RoundRobin:
        return cls()

    def pick(self, urls: Sequence[str], key: RoutingKey | None, in_flight: Mapping[str, int]) -> Decision:
        return Decision(urls[next(self._turn) % len(urls)], "round-robin")

    def release(self, url: str, key: RoutingKey | None) -> None:
        pass


class LeastLoad:
    """Fewest requests in flight (the engines' running + waiting where larger, with views);
    ties rotate, so an idle service still spreads its requests."""

    strategy, keyed, warms = "least-load", False, False

    def __init__(self, views: EngineViews | None = None) -> None:
        self.views = views
        self._turn = 0

    @classmethod
    def create(cls, views: EngineViews | None, config: PrefixAwareConfig) -> LeastLoad:
        return cls(views)

    def load(self, url: str, in_flight: Mapping[str, int]) -> float:
        count = in_flight.get(url, 0)
        return self.views.load(url, count) if self.views else float(count)

    def pick(self, urls: Sequence[str], key: RoutingKey | None, in_flight: Mapping[str, int]) -> Decision:
        self._turn += 1
        count = len(urls)
        order = {url: (index - self._turn) % count for index, url in enumerate(urls)}
        return Decision(min(urls, key=lambda u: (self.load(u, in_flight), order[u])), "least-load")

    def release(self, url: str, key: RoutingKey | None) -> None:
        pass


@dataclass(frozen=True)
class PrefixAwareConfig:
    """The load-balance knobs; defaults and meaning from the router's flags (`flags.py`)."""

    load_penalty_tokens: float = routing_flag("load_penalty_tokens").default
    balance_factor: float = routing_flag("balance_factor").default
    balance_slack: float = routing_flag("balance_slack").default
    kv_usage_limit: float = routing_flag("kv_usage_limit").default
    max_sessions: int = 65536


class PrefixAware:
    """The replica holding the longest cached prefix of the request, minus a load penalty.

    score = cached tokens - load_penalty_tokens x load, among replicas whose load stays within
    (1 + balance_factor) x the mean + balance_slack (consistent hashing with bounded loads) and
    whose KV cache is not full; ties go by rendezvous hashing of the prompt's start, so routers
    agree and a new prefix settles on one replica. A session (`x-session-id` or `user`) keeps
    its replica while that replica stays within those bounds. A request for a LoRA adapter
    goes only among the replicas holding it, when any does.

    A replica being warmed is held back from the requests its warm-ups will serve (those whose
    prompt it will hold more of once they end) while another replica within the bounds can take
    them: sent there now, each would prefill the tenant's prefix a second time beside the warm-up.
    The hold is per prefix and ends when that prefix's warm-up ends (its blocks then count as
    cached there, so the idle replica draws that tenant's share at once), fails, or after the
    warm-up's hold time; every other request may go there meanwhile, so it is never starved.
    """

    strategy, keyed, warms = "prefix-aware", True, True

    def __init__(self, views: EngineViews, config: PrefixAwareConfig = PrefixAwareConfig()) -> None:
        self.views, self.config = views, config
        self.least_load = LeastLoad(views)
        self._sessions: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def create(cls, views: EngineViews | None, config: PrefixAwareConfig) -> PrefixAware:
        if views is None:
            raise ValueError("prefix-aware routing needs the engines' views")
        return cls(views, config)

    def pick(self, urls: Sequence[str], key: RoutingKey | None, in_flight: Mapping[str, int]) -> Decision:
        if key is None:
            return Decision(self.least_load.pick(urls, None, in_flight).url, "no-key")
        now, config, views = time.monotonic(), self.config, self.views
        if key.adapter is not None:   # a replica without the adapter would load it (or 404) first
            urls = [url for url in urls if key.adapter in views.get(url).adapters] or urls
        loads = {url: views.load(url, in_flight.get(url, 0)) for url in urls}
        limit = (sum(loads.values()) + 1) / len(urls) * (1 + config.balance_factor) + config.balance_slack
        eligible = [url for url in urls if loads[url] + 1 <= limit
                    and views.get(url).kv_usage < config.kv_usage_limit] or list(urls)
        matched = {url: views.get(url).matched_blocks(key.hashes, now) for url in urls}
        settled = [url for url in eligible if views.get(url).warming_blocks(key.hashes, now) <= matched[url]]
        held = bool(settled) and len(settled) < len(eligible)
        eligible = settled or eligible
        sticky = self._sessions.get(key.session) if key.session else None
        if sticky in eligible:
            url, reason = sticky, "session"
        else:
            url = max(eligible, key=lambda u: (matched[u] * key.block_size - config.load_penalty_tokens * loads[u],
                                               rendezvous(key.affinity, u)))
            best = max(matched.values())
            reason = ("prefix" if matched[url] == best > 0 else "overload" if best > 0 else "affinity")
        if key.session:
            self._sessions[key.session] = url
            self._sessions.move_to_end(key.session)
            if len(self._sessions) > config.max_sessions:
                self._sessions.popitem(last=False)
        views.sent(url, key.hashes)
        log.debug("%s -> %s (%s): loads %s, cached blocks %s of %d", key.affinity, url, reason,
                  loads, matched, len(key.hashes))
        return Decision(url, reason, matched[url] * key.block_size, held)

    def release(self, url: str, key: RoutingKey | None) -> None:
        if key is not None:
            self.views.ended(url, key.hashes)


PICKERS: dict[str, type[Picker]] = {picker.strategy: picker for picker in (PrefixAware, LeastLoad, RoundRobin)}


def make_picker(strategy: str, views: EngineViews | None,
                config: PrefixAwareConfig = PrefixAwareConfig()) -> Picker:
    if strategy not in PICKERS:
        raise ValueError(f"unknown routing strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    return PICKERS[strategy].create(views, config)
