"""Scraping real HTTP `/metrics` endpoints on 127.0.0.1, as the autoscaler does with pod IPs."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest
from helpers.serve_process import free_port
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kubeinfer.operator.autoscaler.scrape import parse_gauges, scrape
from kubeinfer.server.kube.pods import pod_targets

pytestmark = pytest.mark.integration

WAITING, RUNNING = "vllm:num_requests_waiting", "vllm:num_requests_running"
ENGINE_METRICS = """# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3.0
vllm:num_requests_waiting{model_name="b"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.5
"""


@contextmanager
def serving(app: FastAPI) -> Iterator[int]:
    """Run `app` with uvicorn on an ephemeral 127.0.0.1 port in a thread; yield the port."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=5)


def engine_app(body: str, status: int = 200, delay: float = 0.0) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        time.sleep(delay)  # blocks this server's loop only, as a wedged engine would
        return PlainTextResponse(body, status_code=status)

    return app


def pod(name: str, port: int | None, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    ports = [{"name": "http", "containerPort": port}] if port else []
    return {"metadata": {"name": name, **({"deletionTimestamp": "now"} if deleting else {})},
            "spec": {"containers": [{"name": "engine", "ports": [{"containerPort": 1}, *ports]}]},
            "status": {"podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": str(ready)}]}}



def test_parse_sums_label_sets_and_defaults_missing_gauges_to_zero() -> None:
    gauges = parse_gauges(ENGINE_METRICS, [WAITING, RUNNING, "vllm:absent"])
    assert gauges == {WAITING: 5.0, RUNNING: 1.0, "vllm:absent": 0.0}


def test_pod_targets_use_the_http_port_and_skip_ip_less_pods() -> None:
    no_ip = pod("c", 9000)
    no_ip["status"].pop("podIP")
    targets = pod_targets([pod("a", 9000), pod("b", None, ready=False), no_ip])
    assert [(t.name, t.url, t.ready) for t in targets] == [
        ("a", "http://127.0.0.1:9000/metrics", True),
        ("b", "http://127.0.0.1:1/metrics", False),
        ("c", None, True)]


async def test_scrape_reads_healthy_pods_and_marks_every_failure() -> None:
    with serving(engine_app(ENGINE_METRICS)) as good, serving(engine_app("", 500)) as broken, \
            serving(engine_app("not { prometheus", 200)) as garbled, \
            serving(engine_app(ENGINE_METRICS, delay=1.5)) as slow:
        pods = [pod("good", good), pod("broken", broken), pod("garbled", garbled),
                pod("slow", slow), pod("refused", free_port()),
                pod("starting", good, ready=False), pod("leaving", good, deleting=True)]
        async with httpx.AsyncClient() as client:
            samples = await scrape(client, pod_targets(pods), [WAITING, RUNNING], timeout=0.5)
    by_name = {s.pod: s for s in samples}
    assert set(by_name) == {"good", "broken", "garbled", "slow", "refused", "starting"}
    assert by_name["good"].gauges == {WAITING: 5.0, RUNNING: 1.0}
    assert [n for n, s in by_name.items() if s.ready and s.gauges is None] == \
           ["broken", "garbled", "slow", "refused"]
    assert not by_name["starting"].ready and by_name["starting"].gauges is None


@pytest.mark.parametrize("body", ["", "# only comments\n"])
def test_empty_metrics_page_reads_as_zero(body: str) -> None:
    assert parse_gauges(body, [WAITING]) == {WAITING: 0.0}
