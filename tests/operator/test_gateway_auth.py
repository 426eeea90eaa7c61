"""The gateway in front of engines with API keys: it refuses keyless requests itself (so they
never hold or wake a service at zero), forwards the Authorization header untouched, and
passes an engine's own 401 through unchanged."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_autoscaler_scrape import serving
from test_gateway import CHAT, FakeBackends, held

from kubeinfer.server.router.activator import Activator, ActivatorConfig, GatewayMetrics
from kubeinfer.server.router.cli import add_arguments
from kubeinfer.server.router.proxy import build_app
from kubeinfer.server.api.auth import OPEN_PATHS

pytestmark = pytest.mark.integration

KEY = "sk-gw-0123456789"
ENGINE_401 = {"error": {"message": "incorrect API key provided", "type": "authentication_error",
                        "param": None, "code": "invalid_api_key"}}


def keyed_engine(key: str) -> FastAPI:
    """An engine that checks `key` itself and echoes the Authorization header it received."""
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def any_route(path: str, request: Request) -> JSONResponse:
        given = request.headers.get("authorization")
        if "/" + path not in OPEN_PATHS and given != f"Bearer {key}":
            return JSONResponse(ENGINE_401, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return JSONResponse({"path": path, "authorization": given})

    return app


def keyed_gateway(backends: FakeBackends, keys: list[str] | None) -> tuple[FastAPI,
                                                                            GatewayMetrics]:
    metrics = GatewayMetrics()
    config = ActivatorConfig(activation_timeout=0.5, poll_interval=0.05, wake_interval=60)
    return build_app(Activator(backends, config, metrics), "llm", api_keys=keys), metrics


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", "Basic " + KEY, "Bearer"])
async def test_keyless_request_at_zero_gets_401_and_wakes_nothing(auth: str | None) -> None:
    backends = FakeBackends([], pod_on_wake="http://127.0.0.1:1")
    app, metrics = keyed_gateway(backends, [KEY])
    headers = {"Authorization": auth} if auth else {}
    with serving(app) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "sk-wrong" not in response.text
    assert backends.wakes == 0 and held(metrics) == 0
    assert metrics.registry.get_sample_value("kubeinfer_gateway_requests_total",
                                             {"code": "401"}) == 1


async def test_keyed_request_at_zero_wakes_and_reaches_the_engine_with_its_header() -> None:
    with serving(keyed_engine(KEY)) as engine:
        backends = FakeBackends([], pod_on_wake=f"http://127.0.0.1:{engine}")
        app, _ = keyed_gateway(backends, [KEY, "sk-other"])
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                pending = asyncio.create_task(client.post(
                    "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}))
                await asyncio.to_thread(backends.woken.wait, 10)
                backends.start_pod()
                response = await pending
    assert response.status_code == 200, response.text
    assert response.json() == {"path": "v1/chat/completions", "authorization": f"Bearer {KEY}"}
    assert backends.wakes == 1


async def test_open_paths_pass_without_a_key() -> None:
    with serving(keyed_engine(KEY)) as engine:
        app, _ = keyed_gateway(FakeBackends([f"http://127.0.0.1:{engine}"]), [KEY])
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                answers = {path: await client.get(path) for path in ("/health", "/version")}
                guarded = await client.get("/v1/models")
    assert {path: a.status_code for path, a in answers.items()} == {"/health": 200,
                                                                    "/version": 200}
    assert guarded.status_code == 401


async def test_an_engine_401_passes_through_unchanged() -> None:
    """A gateway without keys (or with keys the engines no longer accept) is transparent."""
    with serving(keyed_engine(KEY)) as engine:
        app, metrics = keyed_gateway(FakeBackends([f"http://127.0.0.1:{engine}"]), None)
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                refused = await client.post("/v1/chat/completions", json=CHAT,
                                            headers={"Authorization": "Bearer sk-wrong"})
                allowed = await client.post("/v1/chat/completions", json=CHAT,
                                            headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401 and refused.json() == ENGINE_401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert allowed.status_code == 200
    assert metrics.registry.get_sample_value("kubeinfer_gateway_requests_total",
                                             {"code": "401"}) == 1


def test_gateway_reads_the_engines_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBEINFER_API_KEYS", f"# rotated 2026-11\n{KEY}\nsk-next\n")
    monkeypatch.setenv("KUBEINFER_REQUIRE_API_KEY", "true")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--inferenceservice", "llm"])
    assert args.api_keys == [KEY, "sk-next"] and args.require_api_key is True
