"""Tenants at the engine's front (`--tenants-file`, `--trust-tenant-header`): the tenant file,
who a request belongs to, priority bounds, quotas (429 in OpenAI's form) and metering that
equals both the responses' `usage` and the engine's own token counters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.server.tenancy import (RateLimiter, TenantError, TenantResolver, TenantTable, TokenBucket,
                                      load_tenants)

pytestmark = pytest.mark.integration

TABLE = {
    "priority_range": [0, 10],
    "objectives": {"interactive": 0, "batch": 8},
    "tenants": [
        {"name": "team-a", "keys": ["sk-a"], "priority": 2},
        {"name": "team-b", "keys": ["sk-b"], "priority": 5,
         "quotas": {"requests_per_minute": 1}},
    ],
}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tenant_file_reads_yaml_and_json_alike(tmp_path: Path) -> None:
    import yaml

    from_yaml = load_tenants(write(tmp_path, "t.yaml", yaml.safe_dump(TABLE)))
    from_json = load_tenants(write(tmp_path, "t.json", json.dumps(TABLE)))
    assert from_yaml == from_json
    assert from_yaml.by_name()["team-b"].quotas.requests_per_minute == 1
    camel = load_tenants(write(tmp_path, "c.yaml", "tenants:\n- name: x\n  quotas: {tokensPerMinute: 5}\n"))
    assert camel.tenants[0].quotas.tokens_per_minute == 5


@pytest.mark.parametrize("text, message", [
    ("tenants:\n- {name: a, keys: [sk-secret-1]}\n- {name: b, keys: [sk-secret-1]}\n", "belongs to two tenants"),
    ("tenants:\n- {name: a}\n- {name: a}\n", "defined twice"),
    ("priority_range: [0, 3]\ntenants:\n- {name: a, priority: 7}\n", "outside priority_range"),
    ("tenants:\n- {name: 'bad name'}\n", "tenants.0.name"),
    ("tenants:\n- {name: a, quotas: {tokens_per_minute: 0}}\n", "tokens_per_minute"),
    ("tenants: [\n", "not valid YAML"),
])
def test_bad_tenant_files_are_refused_without_echoing_keys(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        load_tenants(write(tmp_path, "t.yaml", text))
    assert "sk-secret" not in str(refused.value)


def test_tenant_comes_from_the_key_and_only_a_trusted_gateway_may_name_one() -> None:
    table = TenantTable.model_validate(TABLE)
    untrusted, trusted = TenantResolver(table, False), TenantResolver(table, True)
    headers = {"x-gateway-inference-fairness-id": "team-b", "x-gateway-inference-objective": "batch"}
    by_key = untrusted.identify(0, headers)   # the header is ignored: the key says team-a
    assert (by_key.name, by_key.priority, by_key.header_priority) == ("team-a", 2, None)
    named = trusted.identify(0, headers)
    assert (named.name, named.header_priority) == ("team-b", 8)
    llm_d = trusted.identify(None, {"x-llm-d-inference-fairness-id": "gw-tenant-7",
                                    "x-llm-d-inference-objective": "3"})
    assert (llm_d.name, llm_d.label, llm_d.header_priority) == ("gw-tenant-7", "gw-tenant-7", 3)
    anonymous = trusted.identify(None, {})
    assert (anonymous.name, anonymous.label) == ("", "unknown")
    with pytest.raises(TenantError, match="neither an integer priority nor a known objective"):
        trusted.identify(None, {"x-gateway-inference-objective": "urgent!"})
    with pytest.raises(TenantError, match="printable ASCII"):
        trusted.identify(None, {"x-gateway-inference-fairness-id": "a b"})


def test_priority_stays_within_the_tenants_bounds() -> None:
    resolver = TenantResolver(TenantTable.model_validate(TABLE), True)
    team_a = resolver.identify(0, {})
    assert resolver.priority(team_a, None) == 2   # the tenant's default
    assert resolver.priority(team_a, 9) == 9      # a request may lower its own precedence
    with pytest.raises(TenantError, match=r"priority: 1 is out of range for tenant 'team-a': allowed 2 to 10"):
        resolver.priority(team_a, 1)
    with pytest.raises(TenantError, match="out of range"):
        resolver.priority(team_a, 11)
    gateway = resolver.identify(0, {"x-gateway-inference-objective": "interactive"})
    assert resolver.priority(gateway, 9) == 0     # the trusted gateway's objective wins, whole range


def test_header_named_tenants_get_a_bounded_number_of_labels() -> None:
    resolver = TenantResolver(None, True)
    labels = {resolver.identify(None, {"x-gateway-inference-fairness-id": f"t{i}"}).label for i in range(200)}
    assert len(labels) == 65 and "other" in labels


@pytest.mark.parametrize("tokens_per_minute, seed", [(6000, 0), (60_000, 1), (1200, 2)])
def test_token_quota_admits_the_quota_within_two_percent_over_three_minutes(tokens_per_minute: int,
                                                                           seed: int) -> None:
    """A tenant that always has work (random request sizes, arrivals every 10 ms, random
    finishing times) is admitted, over 3 simulated minutes, its quota within 2%, counting what
    its requests really used (the reservation's unused part comes back when each finishes);
    two replicas each enforcing half the quota admit the same together. The error bound is, per
    replica, one second of its share plus one request (124 tokens at most here): within 2% once
    the 3-minute quota is large against that (6,000 tokens a minute and up)."""
    rng = random.Random(seed)
    for replicas in (1, 2):
        now = [0.0]
        limiters = [RateLimiter(TenantTable.model_validate(
            {"tenants": [{"name": "t", "quotas": {"tokens_per_minute": tokens_per_minute}}]}),
            share=1 / replicas, clock=lambda: now[0]) for _ in range(replicas)]
        pending: list[tuple[float, RateLimiter, int, int]] = []   # (finish time, limiter, reserved, used)
        used_total = 0
        for tick in range(18_000):   # 180 s in 10 ms steps
            now[0] = tick / 100
            for item in [p for p in pending if p[0] <= now[0]]:
                pending.remove(item)
                item[1].refund("t", item[2] - item[3])
            limiter = limiters[tick % replicas]   # requests spread over the replicas
            if limiter.check("t") is None:
                prompt, max_tokens = rng.randint(5, 60), rng.randint(1, 64)
                used = prompt + rng.randint(1, max_tokens)
                limiter.reserve("t", prompt + max_tokens)
                pending.append((now[0] + rng.uniform(0.05, 2.0), limiter, prompt + max_tokens, used))
                used_total += used
        quota = tokens_per_minute * 3
        assert abs(used_total - quota) <= tokens_per_minute / 60 + replicas * 124, (replicas, used_total, quota)
        if tokens_per_minute >= 6000:
            assert abs(used_total - quota) / quota < 0.02, (replicas, used_total, quota)


def test_bucket_says_how_long_to_wait() -> None:
    bucket = TokenBucket(60, now=0.0)   # 1 a second
    assert bucket.wait_seconds(0.0) == 0
    bucket.take(3, 0.0)   # 1 - 3 = -2: two seconds of debt
    assert 2.0 <= bucket.wait_seconds(0.0) <= 2.01
    assert bucket.wait_seconds(2.5) == 0


# -- through the HTTP server, on a tiny random model ---------------------------------------------


@contextlib.contextmanager
def tenant_server(model: str, live_server, table: TenantTable | None, trust_header: bool,
                  **engine_kwargs: object):
    from kubeinfer.server.api.app import build_app
    from kubeinfer.server.api.state import ServerState
    from kubeinfer.server.api.tenancy import Tenancy
    from kubeinfer.server.engine.async_engine import AsyncEngine
    from kubeinfer.server.engine.config import EngineConfig

    config = EngineConfig(model=model, dtype="float32", device="cpu", scheduling_policy="fair", **engine_kwargs)
    engine = AsyncEngine.from_config(config)
    try:
        state = ServerState.create(engine, model, 1024)
        state.tenancy = Tenancy(table, trust_header, [], state.metrics.registry, engine.served_model_name)
        with live_server(build_app(state, [], tenancy=state.tenancy)) as url:
            yield url, state
    finally:
        asyncio.run(engine.shutdown())


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_tenants_are_authenticated_bounded_rate_limited_and_metered(tiny_model_path, live_server) -> None:
    table = TenantTable.model_validate(TABLE)
    with tenant_server(tiny_model_path, live_server, table, trust_header=False) as (url, _):
        def complete(key: str | None, **body) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                              json={"prompt": "hello there", "max_tokens": 5, **body})

        assert complete(None).status_code == 401
        assert complete("sk-nope").status_code == 401
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        for i in range(3):
            reply = complete("sk-a", prompt=f"hello {i} " * (i + 1), n=2, temperature=0)
            assert reply.status_code == 200, reply.text
            for name in ("prompt_tokens", "completion_tokens"):
                usage[name] += reply.json()["usage"][name]
            usage["cached_tokens"] += reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        stream = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer sk-a"}, timeout=60,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                                  "stream_options": {"include_usage": True}})
        last = json.loads([line for line in stream.text.splitlines() if line.startswith("data: {")][-1][6:])
        usage["prompt_tokens"] += last["usage"]["prompt_tokens"]
        usage["completion_tokens"] += last["usage"]["completion_tokens"]
        # an untrusted fairness header changes nothing: the key names the tenant
        spoofed = httpx.post(
            f"{url}/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 2, "priority": 3},
            headers={"Authorization": "Bearer sk-a", "x-gateway-inference-fairness-id": "team-b"})
        assert spoofed.status_code == 200
        usage["prompt_tokens"] += spoofed.json()["usage"]["prompt_tokens"]
        usage["completion_tokens"] += spoofed.json()["usage"]["completion_tokens"]

        low = complete("sk-a", priority=1)
        assert low.status_code == 400
        assert low.json()["error"]["param"] == "priority"
        assert "out of range for tenant 'team-a'" in low.json()["error"]["message"]

        assert complete("sk-b").status_code == 200   # team-b: 1 request a minute
        limited = complete("sk-b")
        assert limited.status_code == 429
        error = limited.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
        assert "requests per minute" in error["message"] and "team-b" in error["message"]
        assert 50 <= int(limited.headers["retry-after"]) <= 60
        assert limited.headers["x-ratelimit-limit-requests"] == "1"
        assert limited.headers["x-kubeinfer-rate-limit"] == "requests_per_minute"

        metrics = samples(url)
        a = (("tenant", "team-a"),)
        assert metrics[("kubeinfer:tenant_prompt_tokens_total", a)] == usage["prompt_tokens"]
        assert metrics[("kubeinfer:tenant_generation_tokens_total", a)] == usage["completion_tokens"]
        assert metrics[("kubeinfer:tenant_cached_prompt_tokens_total", a)] >= usage["cached_tokens"]
        b_prompt = metrics[("kubeinfer:tenant_prompt_tokens_total", (("tenant", "team-b"),))]
        b_generated = metrics[("kubeinfer:tenant_generation_tokens_total", (("tenant", "team-b"),))]
        # the engine's own counters: every token of every tenant, once
        assert metrics[("vllm:prompt_tokens_total", ())] == usage["prompt_tokens"] + b_prompt
        assert metrics[("vllm:generation_tokens_total", ())] == usage["completion_tokens"] + b_generated
        assert metrics[("kubeinfer:tenant_requests_total", (("outcome", "rate_limited"), ("tenant", "team-b")))] == 1
        assert metrics[("kubeinfer:tenant_requests_total", (("outcome", "invalid_priority"), ("tenant", "team-a")))] == 1
        assert metrics[("kubeinfer:tenant_requests_total", (("outcome", "length"), ("tenant", "team-a")))] >= 4


def test_a_trusted_gateway_names_tenants_and_objectives(tiny_model_path, live_server) -> None:
    with tenant_server(tiny_model_path, live_server, None, trust_header=True) as (url, _):
        def complete(headers: dict[str, str]) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                              json={"prompt": "hello", "max_tokens": 3})

        assert complete({"x-gateway-inference-fairness-id": "tenant-x"}).status_code == 200
        assert complete({"x-llm-d-inference-fairness-id": "tenant-y", "x-llm-d-inference-objective": "4"}
                        ).status_code == 200
        bad = complete({"x-gateway-inference-objective": "soonest"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-gateway-inference-objective"
        out_of_range = complete({"x-gateway-inference-objective": "1000"})
        assert out_of_range.status_code == 400 and "out of range" in out_of_range.json()["error"]["message"]
        metrics = samples(url)
        assert metrics[("kubeinfer:tenant_generation_tokens_total", (("tenant", "tenant-x"),))] == 3
        assert metrics[("kubeinfer:tenant_generation_tokens_total", (("tenant", "tenant-y"),))] == 3


def test_serve_refuses_an_unusable_tenant_file_before_loading(tmp_path: Path) -> None:
    import argparse

    from kubeinfer.server.credentials import CredentialFiles

    bad = write(tmp_path, "t.yaml", "tenants:\n- {name: a}\n- {name: a}\n")
    with pytest.raises(SystemExit, match=r"--tenants-file .*t.yaml: .*defined twice"):
        CredentialFiles.from_args(argparse.Namespace(tenants_file=str(bad), trust_tenant_header=False, api_keys=[],
                                                     api_keys_file=None, require_api_key=False,
                                                     key_reload_seconds=0))
