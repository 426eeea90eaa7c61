"""`kubeinfer route` in front of three real `kubeinfer serve` processes on loopback ports.

The issue's 8-tenant shared-system-prompt workload, scaled down to run in a couple of minutes
on 2 vCPUs: 8 tenants, each with its own ~250-token system prompt, 4 chat requests each (32),
concurrency 8, 2 output tokens. Each run uses its own `cache_salt`, so the three runs (a single
engine, prefix-aware through the router, round-robin through a second router) all start cold
on the same three engines. Asserted: the cached prompt tokens the engines report in
`usage.prompt_tokens_details.cached_tokens` through the prefix-aware router are >= 85% of a
single replica's, round-robin's markedly fewer, and the engines' `vllm:prefix_cache_hits`
counters agree with the usage figures.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import pytest
from helpers.serve_process import free_port, start_kubeinfer

from kubeinfer.operator.autoscaler.scrape import parse_gauges

pytestmark = pytest.mark.slow
TENANTS, PER_TENANT, CONCURRENCY = 8, 4, 8
TOPICS = ["garden tools", "train tickets", "tax forms", "pet food", "guitar strings", "bike repair",
          "tea leaves", "phone plans"]


def _start(args: list[str], stack: ExitStack) -> str:
    port = free_port()
    start_kubeinfer(args, port, stack)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster():
    """Three engines, a prefix-aware router and a round-robin router (engines' tokenizer)."""
    with ExitStack() as stack:
        engines = [_start(["serve", "--model", "embedded", "--max-model-len", "512", "--max-num-seqs", "8",
                           "--kv-cache-memory", "384Mi"], stack) for _ in range(3)]
        backends = [arg for url in engines for arg in ("--backend", url)]
        routers = {strategy: _start(["route", *backends, "--strategy", strategy], stack)
                   for strategy in ("prefix-aware", "round-robin")}
        yield engines, routers


def _system_prompt(tenant: int) -> str:
    topic = TOPICS[tenant]
    rules = " ".join(f"Rule {i}: when a customer asks about {topic}, answer in one short sentence, "
                     f"cite the {topic} catalogue and never discuss anything else." for i in range(6))
    return f"Tenant {tenant}. You are the support assistant for {topic}. {rules}"


async def _workload(url: str, salt: str) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of the whole run."""
    bodies = [{"messages": [{"role": "system", "content": _system_prompt(t)},
                            {"role": "user", "content": f"Question {q}: what do you recommend?"}],
               "max_tokens": 2, "temperature": 0, "cache_salt": salt}
              for q in range(PER_TENANT) for t in range(TENANTS)]   # tenants interleave
    slots = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(body: dict) -> dict:
            async with slots:
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()["usage"]

        usages = await asyncio.gather(*(one(body) for body in bodies))
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return cached, sum(u["prompt_tokens"] for u in usages)


def _hits(engines: list[str]) -> float:
    return sum(parse_gauges(httpx.get(url + "/metrics").text, ["vllm:prefix_cache_hits_total"])
               ["vllm:prefix_cache_hits_total"] for url in engines)


def test_prefix_aware_router_keeps_a_single_replicas_cache_hits(cluster) -> None:
    engines, routers = cluster
    before = _hits(engines)
    single, prompt_tokens = asyncio.run(_workload(engines[0], "single-replica"))
    after_single = _hits(engines)
    routed, routed_prompt_tokens = asyncio.run(_workload(routers["prefix-aware"], "prefix-aware"))
    after_routed = _hits(engines)
    robin, _ = asyncio.run(_workload(routers["round-robin"], "round-robin"))
    print(f"cached prompt tokens: single replica {single} of {prompt_tokens}, prefix-aware {routed}, "
          f"round-robin {robin}")
    assert routed_prompt_tokens == prompt_tokens
    assert after_single - before == single and after_routed - after_single == routed
    assert routed >= 0.85 * single
    assert robin <= 0.6 * routed
    decisions = httpx.get(routers["prefix-aware"] + "/metrics").text
    assert 'kubeinfer:router_decisions_total{reason="prefix"}' in decisions
