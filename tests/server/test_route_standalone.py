"""`kubeinfer route` in front of three real `kubeinfer serve` processes on loopback ports.

The issue's 8-tenant workload: each tenant with its own system prompt of over 1,024 tokens, 16
chat requests each (128), concurrency 16, 2 output tokens. The three engines' KV holds about
five of the eight prompts each (128 MiB): room for a replica's share of the tenants, not for
all of them, the case the router is for. "A single replica" is a fourth engine with room for
every prompt (384 MiB). Each run uses its own `cache_salt`, so the three runs (the single
replica, prefix-aware through the router, round-robin through a second router) all start cold.
Asserted: the cached prompt tokens the engines report in `usage.prompt_tokens_details.cached_tokens`
through the prefix-aware router are >= 85% of the single replica's, round-robin's markedly
fewer, and the engines' `vllm:prefix_cache_hits` counters agree with the usage figures.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import pytest
from helpers.serve_process import free_port, start_kubeinfer

from kubeinfer.operator.autoscaler.scrape import parse_gauges

pytestmark = pytest.mark.integration
TENANTS, PER_TENANT, CONCURRENCY = 8, 16, 16
RULES = 34   # 30 tokens each: a system prompt of 1,033 tokens, 1,047 with the question
PROMPT_TOKENS = 1024
TOPICS = ["garden tools", "train tickets", "tax forms", "pet food", "guitar strings", "bike repair",
          "tea leaves", "phone plans"]


def _start(args: list[str], stack: ExitStack) -> str:
    port = free_port()
    start_kubeinfer(args, port, stack)
    return f"http://127.0.0.1:{port}"


def _engine(kv_cache: str, stack: ExitStack) -> str:
    return _start(["serve", "--model", "embedded", "--max-model-len", "2048", "--max-num-seqs", "16",
                   "--kv-cache-memory", kv_cache], stack)


@pytest.fixture(scope="module")
def cluster():
    """Three engines, a prefix-aware router and a round-robin router in front of them (engines'
    tokenizer), and a single replica with room for the whole workload."""
    with ExitStack() as stack:
        engines = [_engine("128Mi", stack) for _ in range(3)]
        backends = [arg for url in engines for arg in ("--backend", url)]
        routers = {strategy: _start(["route", *backends, "--strategy", strategy], stack)
                   for strategy in ("prefix-aware", "round-robin")}
        yield engines, routers, _engine("384Mi", stack)


def _system_prompt(tenant: int) -> str:
    topic = TOPICS[tenant]
    rules = " ".join(f"Rule {i}: when a customer asks about {topic}, answer in one short sentence, "
                     f"cite the {topic} catalogue and never discuss anything else." for i in range(RULES))
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
    assert all(u["prompt_tokens"] > PROMPT_TOKENS for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return cached, sum(u["prompt_tokens"] for u in usages)


def _hits(engines: list[str]) -> float:
    return sum(parse_gauges(httpx.get(url + "/metrics").text, ["vllm:prefix_cache_hits_total"])
               ["vllm:prefix_cache_hits_total"] for url in engines)


def test_prefix_aware_router_keeps_a_single_replicas_cache_hits(cluster) -> None:
    engines, routers, single_replica = cluster
    before = _hits([single_replica])
    single, prompt_tokens = asyncio.run(_workload(single_replica, "single-replica"))
    after_single = _hits([single_replica])
    before_routed = _hits(engines)
    routed, routed_prompt_tokens = asyncio.run(_workload(routers["prefix-aware"], "prefix-aware"))
    after_routed = _hits(engines)
    robin, _ = asyncio.run(_workload(routers["round-robin"], "round-robin"))
    print(f"cached prompt tokens: single replica {single} of {prompt_tokens}, prefix-aware {routed}, "
          f"round-robin {robin}")
    assert routed_prompt_tokens == prompt_tokens
    assert after_single - before == single and after_routed - before_routed == routed
    assert routed >= 0.85 * single
    assert robin <= 0.6 * routed
    decisions = httpx.get(routers["prefix-aware"] + "/metrics").text
    assert 'kubeinfer:router_decisions_total{reason="prefix"}' in decisions
