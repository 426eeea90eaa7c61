"""Routing strategies decide from the engines' published state: the longest cached prefix wins,
load costs tokens, bounded loads and full KV caches exclude a replica, sessions stick, and two
routers with the same engine state pick the same replica."""

from __future__ import annotations

from typing import Mapping

import httpx
import pytest

from kubeinfer.server.router.engine_views import EngineViews
from kubeinfer.server.router.pickers import (LeastLoad, PrefixAware, PrefixAwareConfig, RoundRobin,
                                                make_picker, rendezvous)
from kubeinfer.server.router.routing_key import RoutingKey
from kubeinfer.server.engine.kv_events import HASH_SCHEME, block_hashes

pytestmark = pytest.mark.unit

URLS = ["http://a", "http://b", "http://c"]
BS = 16


def key(tokens: list[int], session: str | None = None, affinity: int = 7) -> RoutingKey:
    return RoutingKey(len(tokens), BS, tuple(block_hashes(tokens[:-1], BS)), affinity, session)


def views(cached: Mapping[str, list[int]] | None = None, **gauges: Mapping[str, float]) -> EngineViews:
    """Engine views as the poll loop fills them: `cached` token prefixes per replica."""
    result = EngineViews(httpx.AsyncClient())
    for url in URLS:
        view = result.get(url)
        tokens = (cached or {}).get(url, [])
        view.apply({"hash": HASH_SCHEME, "block_size": BS, "epoch": "e", "seq": 1, "reset": True,
                    "stored": block_hashes(tokens, BS), "removed": []})
        for name, values in gauges.items():
            setattr(view, name, values.get(url, 0.0))
    return result


SHARED = list(range(1000, 1000 + 20 * BS))   # a 320-token system prompt


def test_longest_cached_prefix_wins_and_predicts_its_tokens() -> None:
    picker = PrefixAware(views({"http://a": SHARED[:4 * BS], "http://b": SHARED, "http://c": []}))
    decision = picker.pick(URLS, key(SHARED + [1, 2, 3]), {})
    assert decision.url == "http://b" and decision.reason == "prefix"
    assert decision.predicted_cached_tokens == 20 * BS


def test_matching_stops_at_the_first_missing_block() -> None:
    state = views({"http://a": SHARED})
    other = SHARED[:BS] + [5] * BS + SHARED[2 * BS:]
    assert state.get("http://a").matched_blocks(key(other).hashes, 0.0) == 1


def test_load_costs_tokens_and_bounded_load_moves_a_hot_prefix() -> None:
    config = PrefixAwareConfig(load_penalty_tokens=32, balance_factor=0.25, balance_slack=2)
    cached = {"http://a": SHARED, "http://b": SHARED[:17 * BS]}
    # a: 20 blocks, 1 in flight (320 - 32 = 288); b: 17 blocks, idle (272): a still wins
    assert PrefixAware(views(cached), config).pick(URLS, key(SHARED + [1]), {"http://a": 1}).url == "http://a"
    # a: 2 in flight (320 - 64 = 256 < 272), within the bounded load: the penalty moves it
    decision = PrefixAware(views(cached), config).pick(URLS, key(SHARED + [1]), {"http://a": 2})
    assert decision.url == "http://b" and decision.reason == "overload"
    assert decision.predicted_cached_tokens == 17 * BS
    # far past the mean: a is excluded however long its prefix
    only_a = {"http://a": SHARED}
    loads = {"http://a": 9, "http://b": 1, "http://c": 2}
    decision = PrefixAware(views(only_a), config).pick(URLS, key(SHARED + [1]), loads)
    assert decision.url == "http://b" and decision.reason == "overload"
    assert decision.predicted_cached_tokens == 0


def test_engine_queue_counts_as_load_and_a_full_kv_cache_gets_nothing_new() -> None:
    cached = {"http://a": SHARED, "http://b": SHARED}
    busy = views(cached, others={"http://a": 4.0})   # other routers' requests run or queue on a
    assert PrefixAware(busy).pick(URLS, key(SHARED + [1]), {}).url == "http://b"
    full = views(cached, kv_usage={"http://b": 0.99, "http://a": 0.5})
    assert PrefixAware(full).pick(URLS, key(SHARED + [1]), {}).url == "http://a"


def test_new_prefix_goes_by_rendezvous_hash_and_then_sticks_before_the_engine_reports_it() -> None:
    state = views()
    picker = PrefixAware(state)
    request = key(SHARED + [1], affinity=12345)
    first = picker.pick(URLS, request, {})
    assert first.reason == "affinity"
    assert first.url == max(URLS, key=lambda u: rendezvous(12345, u))
    # the burst's next request: its blocks count as cached where the first went, though the
    # engine has not published them yet (and that replica now has one in flight)
    second = picker.pick(URLS, request, {first.url: 1})
    assert second.url == first.url and second.reason == "prefix"


def test_two_routers_with_the_same_engine_state_agree() -> None:
    cached = {"http://a": SHARED[:3 * BS], "http://c": SHARED[:3 * BS]}
    for affinity in range(50):
        request = key(SHARED + [affinity], affinity=affinity)
        one, two = PrefixAware(views(cached)), PrefixAware(views(cached))
        assert one.pick(URLS, request, {}).url == two.pick(list(URLS), request, {}).url
    # ties between a and c split by the hash of the prompt's start, not always one way
    winners = {PrefixAware(views(cached)).pick(URLS, key(SHARED, affinity=a), {}).url for a in range(50)}
    assert winners == {"http://a", "http://c"}


def test_session_keeps_its_replica_while_it_is_within_bounds() -> None:
    picker = PrefixAware(views({"http://c": SHARED}))
    first = picker.pick(URLS, key(SHARED + [1], session="s1"), {})
    assert first.url == "http://c"
    # the conversation's next turn is cached nowhere yet, b looks as good: the session decides
    nxt = key(list(range(50, 50 + 5 * BS)), session="s1", affinity=1)
    assert picker.pick(URLS, nxt, {}).reason == "session"
    assert picker.pick(URLS, nxt, {}).url == "http://c"
    # overloaded: the session moves
    moved = picker.pick(URLS, nxt, {"http://c": 10})
    assert moved.url != "http://c" and moved.reason != "session"


def test_a_replica_being_warmed_is_held_back_from_the_prefixes_it_is_warming_only() -> None:
    """c is new and being warmed with SHARED (the hot tenant): while a and b, which hold it, are
    within the bounded load, SHARED's requests go there though c is idle; a prompt c is not
    warming may go to c; past the bound, or once the hold ends, c takes SHARED too."""
    import time

    state = views({"http://a": SHARED, "http://b": SHARED})
    until = time.monotonic() + 60
    state.get("http://c").warming.update(dict.fromkeys(key(SHARED).hashes[:20], until))
    picker = PrefixAware(state, PrefixAwareConfig(load_penalty_tokens=100, balance_factor=0.25, balance_slack=1))
    loads = {"http://a": 2, "http://b": 2}   # c idle: without the hold c would win (320 - 0 > 320 - 200)
    decision = picker.pick(URLS, key(SHARED + [1]), loads)
    assert decision.url in ("http://a", "http://b") and decision.predicted_cached_tokens == 20 * BS
    assert decision.held_off_warming   # counted in kubeinfer:router_warmup_held_requests
    other = list(range(9000, 9000 + 10 * BS))   # a cold tenant's prompt: c is the least loaded
    decision = picker.pick(URLS, key(other, affinity=3), loads)
    assert decision.url == "http://c" and not decision.held_off_warming
    # a and b past the bound ((4 + 4 + 1) / 3 x 1.25 + 1 = 4.75 < 5): not starved, c serves it
    decision = picker.pick(URLS, key(SHARED + [1]), {"http://a": 4, "http://b": 4})
    assert decision.url == "http://c" and not decision.held_off_warming
    # the hold expired (or the warm-up ended): c, idle, draws SHARED again
    state.get("http://c").warming.clear()
    assert picker.pick(URLS, key(SHARED + [1]), loads).url == "http://c"


def test_a_warm_up_partly_done_holds_only_what_is_still_missing() -> None:
    """c holds SHARED's first 8 blocks and is warming all 20: a request whose prompt shares
    only those 8 blocks gains nothing by waiting, so it is not held back."""
    import time

    state = views({"http://a": SHARED, "http://c": SHARED[:8 * BS]})
    state.get("http://c").warming.update(dict.fromkeys(key(SHARED).hashes[:20], time.monotonic() + 60))
    short = SHARED[:8 * BS] + [7] * BS
    picker = PrefixAware(state, PrefixAwareConfig(load_penalty_tokens=100))
    assert picker.pick(URLS, key(short), {"http://a": 2}).url == "http://c"
    assert picker.pick(URLS, key(SHARED + [1]), {"http://a": 2}).url == "http://a"


def test_no_key_falls_back_to_least_load() -> None:
    decision = PrefixAware(views()).pick(URLS, None, {"http://a": 2, "http://b": 0, "http://c": 1})
    assert decision.url == "http://b" and decision.reason == "no-key"


def test_round_robin_and_least_load() -> None:
    robin = RoundRobin()
    assert [robin.pick(URLS, None, {}).url for _ in range(4)] == URLS + URLS[:1]
    least = LeastLoad(views(others={"http://a": 3.0}))
    assert least.pick(URLS, None, {"http://b": 1}).url == "http://c"


def test_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="round-robin"):
        make_picker("random", None)


def test_the_router_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "import kubeinfer.server.router.cli, kubeinfer.server.router.proxy\n"
            "import kubeinfer.server.router.routing, kubeinfer.server.model.checkpoints.tokenizer_files\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_line_scan_of_engine_metrics_agrees_with_the_prometheus_parser() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kubeinfer.operator.autoscaler.scrape import parse_gauges
    from kubeinfer.server.router.engine_views import GAUGES, scan_gauges

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=registry).labels("a").set(3)
    Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=registry).labels("a").set(2)
    Counter("vllm:prefix_cache_hits", "h", ["model_name"], registry=registry).labels("a").inc(1234)
    Gauge("kubeinfer:prefix_cache_hits_recent", "d", ["model_name"], registry=registry).labels("a").set(617.5)
    Gauge("vllm:kv_cache_usage_perc", "u", ["model_name"], registry=registry).labels("a").set(0.25)
    Histogram("vllm:time_to_first_token_seconds", "t", registry=registry).observe(0.3)
    Histogram("kubeinfer:router_overhead_seconds", "o", registry=registry).observe(0.001)
    text = generate_latest(registry).decode()
    assert scan_gauges(text, GAUGES) == parse_gauges(text, GAUGES)
    assert scan_gauges(text, GAUGES)["vllm:kv_cache_usage_perc"] == 0.25
