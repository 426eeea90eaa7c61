"""Tenants at the router: the engine's tenant table names a request's tenant from its key, a
replica enforces its share of each quota (429 in OpenAI's form before anything is forwarded),
tokens are charged from the answer's usage, and a fairness header counts only when trusted."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from helpers.secret_volume import Clock, publish
from prometheus_client import CollectorRegistry
from test_autoscaler_scrape import serving
from test_gateway import CHAT, FakeBackends

from kubeinfer.server.credentials import CredentialFiles
from kubeinfer.server.router.activator import Activator, ActivatorConfig, GatewayMetrics
from kubeinfer.server.router.cli import add_arguments, router_tenancy
from kubeinfer.server.router.proxy import build_app
from kubeinfer.server.router.tenancy import RouterTenancy
from kubeinfer.server.tenancy import TenantTable

pytestmark = pytest.mark.integration

TABLE = TenantTable.model_validate({"tenants": [
    {"name": "chat", "keys": ["sk-chat"], "quotas": {"requests_per_minute": 2}},
    {"name": "batch", "keys": ["sk-batch"], "quotas": {"tokens_per_minute": 600}},
]})


def engine() -> FastAPI:
    """Answers every completion with 30 tokens of usage and echoes the fairness header."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return JSONResponse({"tenant_header": request.headers.get("x-gateway-inference-fairness-id"),
                             "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}})

    return app


def router(url: str, tenancy: RouterTenancy) -> FastAPI:
    config = ActivatorConfig(activation_timeout=1, poll_interval=0.05, wake_interval=60)
    return build_app(Activator(FakeBackends([url]), config, GatewayMetrics()), "llm", tenancy=tenancy)


def post(port: int, key: str | None, **headers: str) -> httpx.Response:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, headers=headers, timeout=10)


def test_each_replica_enforces_its_share_of_the_request_quota() -> None:
    with serving(engine()) as upstream:
        url = f"http://127.0.0.1:{upstream}"
        replicas = [router(url, RouterTenancy(TABLE, False, 2, [])) for _ in range(2)]
        with serving(replicas[0]) as first, serving(replicas[1]) as second:
            assert post(first, None).status_code == 401
            assert post(first, "sk-chat").status_code == 200   # 2 a minute over 2 replicas: 1 each
            assert post(second, "sk-chat").status_code == 200
            refused = post(first, "sk-chat")
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert refused.json()["error"]["type"] == "requests"
            assert refused.headers["x-kubeinfer-rate-limit"] == "requests_per_minute"
            assert refused.headers["x-ratelimit-limit-requests"] == "2"   # the tenant's quota, all replicas
            assert 50 <= int(refused.headers["retry-after"]) <= 60
            assert post(first, "sk-batch").status_code == 200   # another tenant is not affected


def test_refusals_are_counted_per_tenant_on_the_routers_metrics() -> None:
    """The router's refusals never reach an engine: it counts them, in the engines' counter."""
    metrics = GatewayMetrics()
    tenancy = RouterTenancy(TABLE, False, 1, [], registry=metrics.registry)
    with serving(engine()) as upstream:
        config = ActivatorConfig(activation_timeout=1, poll_interval=0.05, wake_interval=60)
        app = build_app(Activator(FakeBackends([f"http://127.0.0.1:{upstream}"]), config, metrics), "llm",
                        tenancy=tenancy)
        with serving(app) as port:
            assert [post(port, "sk-chat").status_code for _ in range(2)] == [200, 429]   # 2 a minute, evenly
            bad = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "priority": 1000},
                             headers={"Authorization": "Bearer sk-batch"}, timeout=10)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'kubeinfer:tenant_requests_total{outcome="rate_limited",tenant="chat"} 1.0' in text
    assert 'kubeinfer:tenant_requests_total{outcome="invalid_priority",tenant="batch"} 1.0' in text


def test_tokens_are_charged_from_the_answers_usage() -> None:
    with serving(engine()) as upstream:
        app = router(f"http://127.0.0.1:{upstream}", RouterTenancy(TABLE, False, 1, []))
        with serving(app) as port:
            assert post(port, "sk-batch").status_code == 200   # 10 a second: 30 tokens are a 2 s debt
            refused = post(port, "sk-batch")
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
            assert refused.headers["x-kubeinfer-rate-limit"] == "tokens_per_minute"
            assert 2 <= int(refused.headers["retry-after"]) <= 3


def test_tokens_in_flight_count_before_their_answers_end() -> None:
    """The estimate (prompt bytes / 4 + max_tokens) is reserved as a request is admitted, so a
    tenant's concurrent requests cannot all pass while the first answers are still running."""
    release = threading.Event()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        await asyncio.to_thread(release.wait, 10)
        return JSONResponse({"usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}})

    with serving(app) as upstream:
        activator = Activator(FakeBackends([f"http://127.0.0.1:{upstream}"]),
                              ActivatorConfig(activation_timeout=1, wake_interval=60), GatewayMetrics())
        router_app = build_app(activator, "llm", tenancy=RouterTenancy(TABLE, False, 1, []))
        with serving(router_app) as port, ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"http://127.0.0.1:{port}/v1/chat/completions",
                                json={**CHAT, "max_tokens": 40}, headers={"Authorization": "Bearer sk-batch"},
                                timeout=10)
            deadline = time.monotonic() + 10
            while sum(activator.in_flight.values()) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            second = post(port, "sk-batch")   # 10 tokens a second: the first's 57 are a debt already
            release.set()
            assert first.result().status_code == 200
    assert second.status_code == 429 and second.headers["x-kubeinfer-rate-limit"] == "tokens_per_minute"


def test_fairness_headers_count_only_from_a_trusted_gateway() -> None:
    with serving(engine()) as upstream:
        url = f"http://127.0.0.1:{upstream}"
        with serving(router(url, RouterTenancy(TABLE, False, 1, []))) as untrusted:
            # named "batch" by a header it may not set: still "chat" by its key, so its quota applies
            for _ in range(2):
                post(untrusted, "sk-chat", **{"x-gateway-inference-fairness-id": "batch"})
            assert post(untrusted, "sk-chat", **{"x-gateway-inference-fairness-id": "batch"}).status_code == 429
        with serving(router(url, RouterTenancy(TABLE, True, 1, []))) as trusted:
            bad = post(trusted, "sk-batch", **{"x-gateway-inference-objective": "whenever"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-gateway-inference-objective"
            named = post(trusted, "sk-chat", **{"x-gateway-inference-fairness-id": "team-z"})
            assert named.status_code == 200 and named.json()["tenant_header"] == "team-z"   # forwarded as sent


def test_the_queue_orders_by_the_requests_priority_and_charges_its_usage() -> None:
    """The router's queue ranks a request as the engine would (priority within the tenant's
    bounds, else 400 before it waits) and its fair share counts the tokens the answer used."""
    table = TenantTable.model_validate({"priority_range": [0, 10], "tenants": [
        {"name": "batch", "keys": ["sk-batch"], "priority": 4}]})
    with serving(engine()) as upstream:
        activator = Activator(FakeBackends([f"http://127.0.0.1:{upstream}"]),
                              ActivatorConfig(activation_timeout=1, wake_interval=60), GatewayMetrics())
        app = build_app(activator, "llm", tenancy=RouterTenancy(table, False, 1, []))
        with serving(app) as port:
            headers = {"Authorization": "Bearer sk-batch"}
            bad = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "priority": 1},
                             headers=headers, timeout=10)
            ok = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                            json={**CHAT, "priority": 6, "max_tokens": 500}, headers=headers, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_priority"
    assert "allowed 4 to 10" in bad.json()["error"]["message"]
    assert ok.status_code == 200
    assert activator.share.standing("batch") == 30   # the estimate (over 500) corrected to the usage


@pytest.mark.parametrize("argv, enabled", [([], False), (["--trust-tenant-header"], True)])
def test_route_takes_the_engines_tenant_flags(argv: list[str], enabled: bool) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "http://127.0.0.1:1", "--quota-replicas", "3", *argv])
    tenancy = router_tenancy(args, CredentialFiles.from_args(args), GatewayMetrics())
    assert (tenancy is not None) == enabled


def test_a_rotated_tenant_key_and_quota_reach_the_router_without_a_restart(tmp_path: Path) -> None:
    """The tenants' key Secret and the table change under a running router (as the kubelet
    updates a Secret volume): after --key-reload-seconds the old key gets 401, the new one
    names its tenant, and the new quota applies."""
    tenants = "tenants:\n  - name: chat\n    keys_file: keys/chat\n    quotas: {requests_per_minute: %d}\n"
    publish(tmp_path, {"tenants.yaml": tenants % 600, "keys/chat": "sk-chat-old\n"})
    clock = Clock()
    files = CredentialFiles([], None, str(tmp_path / "tenants.yaml"), interval=5, clock=clock)
    registry = CollectorRegistry()
    files.count_reloads(registry)
    with serving(engine()) as upstream:
        app = router(f"http://127.0.0.1:{upstream}", RouterTenancy(files.current.table, False, 1, [], files))
        with serving(app) as port:
            assert post(port, "sk-chat-old").status_code == 200
            publish(tmp_path, {"tenants.yaml": tenants % 6, "keys/chat": "sk-chat-new\n"})
            assert post(port, "sk-chat-old").status_code == 200   # looked at again only after 5 s
            clock.now += 5
            refused = post(port, "sk-chat-old")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert post(port, "sk-chat-new").status_code == 200
            limited = post(port, "sk-chat-new")   # 6 a minute now: one per 10 s
            assert limited.status_code == 429 and limited.headers["x-ratelimit-limit-requests"] == "6"
    assert registry.get_sample_value("kubeinfer:credential_reloads_total", {"outcome": "applied"}) == 1
