"""The router's picture of each engine, read from the engines themselves.

Every `interval` it pulls each Ready engine's `GET /kv/blocks?since=SEQ` (the block hashes its
prefix cache gained and lost, keyed with the service's secret; on the engines' admin port) and, every `metrics_interval`, its queue gauges from `/metrics`.
Decisions then depend on engine state, not on one router's history, so several router replicas
choose alike without talking. The one exception is short-lived: blocks of a request a router
has just sent count as cached there for `pending_seconds`, until the engine's digest shows them
(otherwise a burst sharing a new prefix would scatter before the first poll): from the moment
they are sent until `pending_seconds` after the request ended (a slow engine may queue them).
A replica being warmed (`warmup.py`) also lists the blocks its warm-ups will bring, `warming`,
until each warm-up ends or its hold expires: the prefix-aware picker keeps the requests those
blocks would serve off it meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping, Sequence

import httpx

from ..engine.kv_events import UNKEYED, BlockHasher
from ..model.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def scan_gauges(text: str, names: Sequence[str]) -> dict[str, float]:
    """The sum of each metric over its label sets, from the exposition text by a line scan: a
    router reads every engine's /metrics each second or so, and the full Prometheus parser
    over the engines' histograms cost it more CPU than routing."""
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith(("vllm:", "kubeinfer:")):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def admin_url(url: str, admin_port: int | None) -> str:
    """`url` (an engine's API) with the engines' admin port, where it has one."""
    if admin_port is None:
        return url
    parsed = httpx.URL(url)
    return str(parsed.copy_with(port=admin_port)).rstrip("/")


@dataclass
class EngineView:
    url: str
    scheme: str = UNKEYED.scheme   # the block hashes this router computes: the engine's must match
    epoch: str | None = None
    seq: int | None = None
    block_size: int | None = None
    cached: set[int] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)   # hash -> until (monotonic)
    warming: dict[int, float] = field(default_factory=dict)   # hash -> hold until (monotonic)
    running: float = 0.0
    waiting: float = 0.0
    others: float = 0.0   # running + waiting that are not this router's, at the last scrape
    kv_usage: float = 0.0
    metrics_at: float = float("-inf")
    adapters: frozenset[str] = frozenset()   # LoRA adapters it holds (its /v1/models)
    models: frozenset[str] = frozenset()     # every model name it serves (its /v1/models)

    def has(self, block: int, now: float) -> bool:
        return block in self.cached or self.pending.get(block, 0.0) > now

    def matched_blocks(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` this engine holds. A cache holds a block's parents too
        (leaves are evicted first), so the held blocks are a prefix: binary search."""
        return _leading(hashes, lambda block: self.has(block, now))

    def warming_blocks(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` this engine will hold once its warm-ups in flight end
        (a warm-up sends a prefix from its first block, so these are a prefix too)."""
        if not self.warming:
            return 0
        return _leading(hashes, lambda block: self.has(block, now) or self.warming.get(block, 0.0) > now)

    def apply(self, digest: dict) -> None:
        if digest.get("hash") != self.scheme:   # e.g. an engine without the service's key
            raise ValueError(f"block hash scheme {digest.get('hash')!r}, expected {self.scheme!r}")
        if not digest["reset"] and digest["epoch"] == self.epoch and self.seq is not None \
                and digest["seq"] < self.seq:
            return   # an older read answered after a newer one (the warm-up's check, the poll loop)
        if digest["reset"] or digest["epoch"] != self.epoch:
            self.cached = set(digest["stored"])
        else:
            self.cached.difference_update(digest["removed"])
            self.cached.update(digest["stored"])
        self.epoch, self.seq, self.block_size = digest["epoch"], digest["seq"], digest["block_size"]


def _leading(hashes: Sequence[int], held: Callable[[int], bool]) -> int:
    low, high = 0, len(hashes)
    while low < high:
        middle = (low + high + 1) // 2
        if held(hashes[middle - 1]):
            low = middle
        else:
            high = middle - 1
    return low


class EngineViews:
    def __init__(self, client: httpx.AsyncClient, interval: float = 0.5, metrics_interval: float = 2.0,
                 pending_seconds: float = 2.0, timeout: float = 2.0, admin_port: int | None = None,
                 hasher: BlockHasher = UNKEYED) -> None:
        """`admin_port`: the engines' --admin-port (the digest, tokenizer and adapters are read
        there); `hasher`: the service's keyed block hashes, which the engines' must match."""
        self.client, self.interval, self.metrics_interval = client, interval, metrics_interval
        self.pending_seconds, self.timeout = pending_seconds, timeout
        self.admin_port, self.hasher = admin_port, hasher
        self.views: dict[str, EngineView] = {}
        self.in_flight: Mapping[str, int] = {}   # this router's own requests (the activator's count)
        self.api_key: str | None = None   # for /v1/models when the engines want keys

    def adapters(self) -> frozenset[str]:
        """Every LoRA adapter some engine holds: the model names that route by adapter."""
        return frozenset().union(*(view.adapters for view in self.views.values()))

    def models(self) -> frozenset[str]:
        """Every model name some engine serves (base models and adapters); empty until one answered."""
        return frozenset().union(*(view.models for view in self.views.values()))

    def get(self, url: str) -> EngineView:
        view = self.views.get(url)
        if view is None:
            view = self.views[url] = EngineView(url, self.hasher.scheme)
        return view

    def load(self, url: str, in_flight: int) -> float:
        """This router's own in-flight count, now, plus the requests of others (other routers,
        direct clients) the engine ran or queued at the last scrape."""
        view = self.views.get(url)
        return in_flight + (view.others if view else 0.0)

    def sent(self, url: str, hashes: Iterable[int]) -> None:
        """Count `hashes` as cached at `url` while the request runs (see `ended`)."""
        pending = self.get(url).pending
        for block in hashes:
            pending[block] = float("inf")

    def ended(self, url: str, hashes: Iterable[int]) -> None:
        """The request is done, so the engine has scheduled (and published) its blocks: they stay
        pending only until the next polls have surely seen them."""
        until = time.monotonic() + self.pending_seconds
        pending = self.get(url).pending
        for block in hashes:
            if block in pending:
                pending[block] = until

    async def refresh(self, urls: Sequence[str]) -> None:
        for gone in set(self.views) - set(urls):
            del self.views[gone]
        await asyncio.gather(*(self._poll(self.get(url)) for url in urls))

    async def _poll(self, view: EngineView) -> None:
        now = time.monotonic()
        try:
            await self.read_digest(view)
            if now - view.metrics_at >= self.metrics_interval:
                response = await self.client.get(f"{view.url}/metrics", timeout=self.timeout)
                response.raise_for_status()
                gauges = scan_gauges(response.text, GAUGES)
                view.running, view.waiting = gauges[GAUGES[0]], gauges[GAUGES[1]]
                view.others = max(0.0, view.running + view.waiting - self.in_flight.get(view.url, 0))
                view.kv_usage, view.metrics_at = gauges[GAUGES[2]], now
                view.models, view.adapters = await self._models(view.url)
        except (httpx.HTTPError, ValueError, KeyError) as error:
            log.debug("engine %s: %s", view.url, error or type(error).__name__)
        if view.pending:
            view.pending = {block: until for block, until in view.pending.items() if until > now}
        if view.warming:
            view.warming = {block: until for block, until in view.warming.items() if until > now}

    async def read_digest(self, view: EngineView) -> None:
        """Bring `view.cached` up to date with the engine's `/kv/blocks` now."""
        params = {} if view.seq is None else {"since": view.seq}
        response = await self.client.get(f"{admin_url(view.url, self.admin_port)}/kv/blocks", params=params,
                                         timeout=self.timeout)
        if response.status_code == 200:
            view.apply(response.json())

    async def _models(self, url: str) -> tuple[frozenset[str], frozenset[str]]:
        """(every model, the adapters) `/v1/models` lists (vLLM gives each adapter a `parent`);
        none if it will not say."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = await self.client.get(f"{admin_url(url, self.admin_port)}/v1/models", headers=headers,
                                         timeout=self.timeout)
        if response.status_code != 200:
            return frozenset(), frozenset()
        cards = response.json().get("data") or []
        return (frozenset(card["id"] for card in cards),
                frozenset(card["id"] for card in cards if card.get("parent")))

    async def run(self, ready: Callable[[], Awaitable[list[str]]]) -> None:
        """Poll forever (the router's lifetime), over whichever engines are Ready."""
        while True:
            try:
                await self.refresh(await ready())
            except Exception as error:  # noqa: BLE001 - the poll loop must outlive any one failure
                log.warning("engine poll failed: %s", error)
            await asyncio.sleep(self.interval)

    async def fetch_tokenizer(self, urls: Sequence[str]) -> tuple[Tokenizer, int] | None:
        """The tokenizer and block size the first answering engine serves (GET /tokenizer_info)."""
        for url in urls:
            try:
                response = await self.client.get(f"{admin_url(url, self.admin_port)}/tokenizer_info", timeout=30.0)
                response.raise_for_status()
                info = response.json()
                if info.get("hash") != self.hasher.scheme or not info.get("block_size"):
                    log.warning("engine %s hashes blocks as %r, this router as %r: no routing keys from it",
                                url, info.get("hash"), self.hasher.scheme)
                    continue
                return Tokenizer.from_description(info), int(info["block_size"])
            except (httpx.HTTPError, ValueError, KeyError) as error:
                log.warning("no tokenizer from %s: %s", url, error or type(error).__name__)
        return None
