"""`kubeinfer route` warms an engine that becomes Ready with the hottest shared prefixes.

Two real `kubeinfer serve` processes on loopback ports behind a prefix-aware router: engine A
serves four tenants (two chat requests each, so each system prompt is shared) and a fifth
tenant once; then engine B starts (a scale-up). The router sends B the four shared prefixes as
prefill-only requests; A is then stopped, so the next request of every tenant goes to B: the
four hot tenants' first requests on B find their system prompts cached, the fifth tenant's
(seen once, so not recorded as shared) does not.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest
from helpers.serve_process import free_port, start_kubeinfer

from kubeinfer.operator.autoscaler.scrape import parse_gauges

pytestmark = pytest.mark.integration
HOT, COLD = range(4), 4
ENGINE = ["serve", "--model", "embedded", "--max-model-len", "512", "--max-num-seqs", "8",
          "--kv-cache-memory", "256Mi"]
SENT = 'kubeinfer:router_warmup_requests_total{outcome="sent"}'


def _chat(router: str, tenant: int, question: str) -> dict:
    rules = " ".join(f"Rule {i}: tenant {tenant} answers in one short sentence and cites catalogue "
                     f"{tenant} only." for i in range(8))
    body = {"messages": [{"role": "system", "content": f"You are the assistant of tenant {tenant}. {rules}"},
                         {"role": "user", "content": f"Question {question}: what do you recommend?"}],
            "max_tokens": 2, "temperature": 0, "cache_salt": "warm-up-test"}
    response = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def _hits(engine: str) -> float:
    name = "vllm:prefix_cache_hits_total"
    return parse_gauges(httpx.get(f"{engine}/metrics").text, [name])[name]


def _router_metric(router: str, sample: str) -> float:
    """One sample (name and labels, as exposed) of the router's metrics; 0 before it exists."""
    for line in httpx.get(f"{router}/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_engine_that_becomes_ready_is_warmed_with_the_shared_prefixes() -> None:
    old_port, new_port, router_port = free_port(), free_port(), free_port()
    old, new, router = (f"http://127.0.0.1:{port}" for port in (old_port, new_port, router_port))
    with ExitStack() as stack:
        old_engine = start_kubeinfer(ENGINE, old_port, stack)
        start_kubeinfer(["route", "--backend", old, "--backend", new, "--strategy", "prefix-aware"], router_port, stack)
        deadline = time.monotonic() + 120   # the router has the engines' tokenizer: requests carry keys
        while 'reason="affinity"' not in httpx.get(f"{router}/metrics").text:
            _chat(router, 99, f"probe {time.monotonic()}")
            assert time.monotonic() < deadline, "the router never routed by key"
            time.sleep(1.0)
        for tenant in HOT:
            for question in range(2):
                _chat(router, tenant, str(question))
        _chat(router, COLD, "0")

        start_kubeinfer(ENGINE, new_port, stack)   # scale-up: B becomes Ready and is warmed in the background
        deadline = time.monotonic() + 180
        while _router_metric(router, SENT) < len(HOT):
            assert time.monotonic() < deadline, httpx.get(f"{router}/metrics").text
            time.sleep(0.5)
        warm_tokens = _router_metric(router, "kubeinfer:router_warmup_tokens_total")
        old_engine.terminate()
        old_engine.wait(timeout=60)
        hits_before = _hits(new)

        usages = {tenant: _chat(router, tenant, "after the scale-up") for tenant in [*HOT, COLD]}
        cached = {tenant: usage["prompt_tokens_details"]["cached_tokens"] for tenant, usage in usages.items()}
        print(f"warm-up: {_router_metric(router, SENT):g} requests, {warm_tokens:g} tokens; "
              f"cached prompt tokens on the new engine: {cached}")
        assert all(cached[tenant] > 0.5 * usages[tenant]["prompt_tokens"] for tenant in HOT), cached
        assert cached[COLD] == 0
        assert _hits(new) - hits_before == sum(cached.values())   # all five served by the new engine


def test_two_routers_warming_the_same_engine_have_it_prefill_each_prefix_once() -> None:
    """Two routers' warmers (no shared state, as two router replicas) notice one real engine at
    the same moment with the same four hot prefixes. Whatever the interleaving, the engine
    computes each prefix's blocks once: a router that comes second skips a prefix the engine's
    digest shows, and a copy sent before then finds all but its last block cached (the engine
    shares a prompt's blocks from the step that schedules them). The prompt tokens the engine
    computed equal what the two routers' counts say."""
    import asyncio
    import random

    from kubeinfer.server.router.engine_views import EngineViews
    from kubeinfer.server.router.routing_key import RoutingKey
    from kubeinfer.server.router.warmup import HotPrefixes, Warmer, WarmupConfig
    from kubeinfer.server.engine.kv_events import block_hash, block_hashes, root_hash

    port = free_port()
    engine = f"http://127.0.0.1:{port}"
    counts: list[tuple[str, int]] = []
    with ExitStack() as stack:
        start_kubeinfer(ENGINE, port, stack)
        block_size = int(httpx.get(f"{engine}/tokenizer_info").json()["block_size"])
        hot = HotPrefixes()
        for tenant in range(4):
            system = [1000 + 100 * tenant + i % 90 for i in range(8 * block_size)]
            for q in range(2):
                tokens = system + [50 + q] * (block_size + 1)
                hot.observe(RoutingKey(len(tokens), block_size, tuple(block_hashes(tokens[:-1], block_size, "two")),
                                       block_hash(root_hash("two"), tokens[:32]), salt="two", tokens=tokens))
        before = parse_gauges(httpx.get(f"{engine}/metrics").text, ["vllm:prompt_tokens_total"])

        async def warm() -> None:
            async with httpx.AsyncClient() as client:
                routers = [Warmer(hot, EngineViews(client), client, WarmupConfig(prefixes=4, digest_wait=0),
                                  lambda outcome, tokens: counts.append((outcome, tokens)), rng=random.Random(seed))
                           for seed in (1, 2)]
                for warmer in routers:
                    warmer.notice([engine])
                await asyncio.gather(*(task for warmer in routers for task in warmer._tasks))

        asyncio.run(warm())
        after = parse_gauges(httpx.get(f"{engine}/metrics").text, ["vllm:prompt_tokens_total"])
        hits = _hits(engine)
    computed = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] - hits
    print(f"two routers' warm-up outcomes: {sorted(counts)}; engine computed {computed:g} prompt tokens")
    assert sorted(outcome for outcome, _ in counts) == ["cached"] * 4 + ["sent"] * 4
    assert sum(tokens for outcome, tokens in counts if outcome == "sent") == 4 * 8 * block_size
    assert computed == sum(tokens for _, tokens in counts)   # copies cost their last block at most
    assert computed <= 4 * 8 * block_size + 4 * block_size
