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

pytestmark = pytest.mark.slow
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
