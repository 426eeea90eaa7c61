"""The scale-from-zero gateway against real upstream engines on 127.0.0.1 and a fake scaler."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import AsyncExitStack
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
import pytest

from test_autoscaler_scrape import free_port, serving

from kubeinfer.server.router.activator import Activator, ActivatorConfig, GatewayMetrics
from kubeinfer.server.router.proxy import build_app

pytestmark = pytest.mark.integration

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def upstream(tag: str, release: threading.Event | None = None) -> FastAPI:
    """A tiny OpenAI-shaped engine; its stream pauses after one event until `release` is set."""
    app = FastAPI()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        payload = await request.json()
        if payload.get("model") != "m":
            return JSONResponse({"error": {"message": "no such model", "type":
                                           "not_found_error", "param": "model", "code": None}},
                                status_code=404)
        if not payload.get("stream"):
            return JSONResponse({"pod": tag, "echo": payload["messages"][0]["content"],
                                 "query": dict(request.query_params),
                                 "header": request.headers.get("x-trace")})

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"delta": "one"}\n\n'
            while release is not None and not release.is_set():
                await asyncio.sleep(0.01)
            yield b'data: {"delta": "two"}\n\ndata: [DONE]\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class FakeBackends:
    """Pods appear when the test says so; `wake` records the 0 -> 1 request like the API would."""

    def __init__(self, urls: list[str], pod_on_wake: str | None = None) -> None:
        self.urls, self.pod_on_wake = urls, pod_on_wake
        self.wakes = self.forgets = 0
        self.woken = threading.Event()

    async def ready(self) -> list[str]:
        return list(self.urls)

    async def wake(self) -> bool:
        self.wakes += 1
        self.woken.set()
        return self.wakes == 1

    def forget(self) -> None:
        self.forgets += 1

    def start_pod(self) -> None:
        assert self.pod_on_wake
        self.urls.append(self.pod_on_wake)


def gateway(backends: FakeBackends, timeout: float = 30.0) -> tuple[FastAPI, GatewayMetrics]:
    metrics = GatewayMetrics()
    config = ActivatorConfig(activation_timeout=timeout, poll_interval=0.05, wake_interval=60)
    return build_app(Activator(backends, config, metrics), "llm", retry_after=7), metrics


def retries(metrics: GatewayMetrics) -> dict[str, float]:
    """kubeinfer:router_retries_total by reason."""
    return {reason: metrics.registry.get_sample_value("kubeinfer:router_retries_total", {"reason": reason}) or 0.0
            for reason in ("refused", "unanswered")}


def held(metrics: GatewayMetrics) -> float:
    return metrics.registry.get_sample_value("kubeinfer_gateway_held_requests") or 0.0


async def test_forwards_requests_with_query_headers_and_upstream_errors() -> None:
    with serving(upstream("a")) as engine:
        app, metrics = gateway(FakeBackends([f"http://127.0.0.1:{engine}"]))
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                ok = await client.post("/v1/chat/completions?user=u1", json=CHAT,
                                       headers={"x-trace": "t-9"})
                missing = await client.post("/v1/chat/completions", json={**CHAT, "model": "x"})
                scraped = await client.get("/metrics")
    assert ok.status_code == 200
    assert ok.json() == {"pod": "a", "echo": "hi", "query": {"user": "u1"}, "header": "t-9"}
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert 'kubeinfer_gateway_requests_total{code="404"} 1.0' in scraped.text


async def test_streams_events_as_they_arrive() -> None:
    release = threading.Event()
    with serving(upstream("a", release)) as engine:
        app, _ = gateway(FakeBackends([f"http://127.0.0.1:{engine}"]))
        with serving(app) as port:
            async with httpx.AsyncClient() as client:
                async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                         json={**CHAT, "stream": True}) as response:
                    chunks = response.aiter_text()
                    first = await chunks.__anext__()  # arrives while the engine still holds "two"
                    release.set()
                    rest = "".join([chunk async for chunk in chunks])
    assert response.headers["content-type"].startswith("text/event-stream")
    assert first == 'data: {"delta": "one"}\n\n'
    assert rest == 'data: {"delta": "two"}\n\ndata: [DONE]\n\n'


async def test_request_at_zero_is_held_wakes_one_replica_and_completes() -> None:
    with serving(upstream("new")) as engine:
        backends = FakeBackends([], pod_on_wake=f"http://127.0.0.1:{engine}")
        app, metrics = gateway(backends)
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
                await asyncio.to_thread(backends.woken.wait, 10)
                while held(metrics) != 1:
                    await asyncio.sleep(0.01)
                assert not pending.done()
                backends.start_pod()  # the pod became Ready
                response = await pending
    assert response.status_code == 200 and response.json()["pod"] == "new"
    assert backends.wakes == 1 and held(metrics) == 0
    assert metrics.registry.get_sample_value("kubeinfer_gateway_activations_total") == 1
    assert metrics.registry.get_sample_value("kubeinfer_gateway_hold_seconds_count") == 1


async def test_past_the_activation_timeout_answers_503_with_retry_after() -> None:
    app, metrics = gateway(FakeBackends([]), timeout=0.3)
    with serving(app) as port:
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                         json=CHAT)
    assert response.status_code == 503 and response.headers["retry-after"] == "7"
    error = response.json()["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "no_ready_replica"
    assert "llm" in error["message"] and "0.3s" in error["message"]
    assert held(metrics) == 0


async def test_a_pod_refusing_connections_is_skipped_for_a_ready_one() -> None:
    with serving(upstream("alive")) as engine:
        backends = FakeBackends([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{engine}"])
        app, metrics = gateway(backends)
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                answers = [await client.post("/v1/chat/completions", json=CHAT)
                           for _ in range(2)]
    assert [a.json()["pod"] for a in answers] == ["alive", "alive"]
    assert backends.forgets == 1  # the dead pod was hit once, then the other got it
    assert retries(metrics) == {"refused": 1.0, "unanswered": 0.0}


async def test_least_loaded_pod_first_then_round_robin() -> None:
    urls = ["http://a", "http://b", "http://c"]
    activator = Activator(FakeBackends(urls), ActivatorConfig(), GatewayMetrics())
    async with AsyncExitStack() as stack:
        busy = [await stack.enter_async_context(activator.upstream()) for _ in range(3)]
        assert sorted(busy) == urls  # each concurrent request got its own pod
    turns = []
    for _ in range(3):
        async with activator.upstream() as url:
            turns.append(url)
    assert sorted(turns) == urls


class RawEngine:
    """A TCP 'engine' on 127.0.0.1 that reads one request and then answers `reply` raw and
    closes: b"" is a pod that hangs up without answering."""

    def __init__(self, reply: bytes) -> None:
        import socket

        self.reply = reply
        self.accepted = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                conn.sendall(self.reply)


async def test_a_pod_closing_the_connection_without_answering_is_retried_on_another() -> None:
    hangs_up = RawEngine(b"")
    with serving(upstream("alive")) as engine:
        app, metrics = gateway(FakeBackends([hangs_up.url, f"http://127.0.0.1:{engine}"]))
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert {a.json()["pod"] for a in answers} == {"alive"}
    assert hangs_up.accepted >= 1 and retries(metrics) == {"refused": 0.0, "unanswered": hangs_up.accepted}


async def test_a_stream_whose_pod_goes_away_ends_with_an_openai_error_event() -> None:
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    event = b'data: {"delta": "one"}\n\n'
    dies = RawEngine(head + f"{len(event):x}\r\n".encode() + event + b"\r\n")   # then closes mid-stream
    app, _ = gateway(FakeBackends([dies.url]))
    with serving(app) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert answer.status_code == 200
    events = [line[len("data: "):] for line in answer.text.split("\n\n") if line]
    assert events[0] == '{"delta": "one"}' and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "went away" in error["message"]
