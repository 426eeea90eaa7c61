"""The conformance suite (`e2e/conformance.py`) passes on kubeinfer: a real engine with vLLM's
KV events on, and `kubeinfer route --ext-proc-port` as the endpoint picker in front of it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import ExitStack

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.serve_process import free_port, start_kubeinfer

from e2e.conformance import run_suite

pytestmark = pytest.mark.integration


def test_kubeinfer_passes_every_item(tiny_model_path: str, tmp_path) -> None:
    with ExitStack() as stack:
        port, replay, epp = free_port(), free_port(), free_port()
        events = f"ipc://{tmp_path}/kv-events.sock"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        start_kubeinfer(["serve", "--model", tiny_model_path, "--dtype", "float32", "--block-size", "16",
                         "--kv-events-config", json.dumps(config)], port, stack)
        router = subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", "route", "--no-http",
                                   "--backend", f"http://127.0.0.1:{port}", "--ext-proc-port", str(epp)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lambda: (router.terminate(), router.wait(timeout=15)))
        with grpc.insecure_channel(f"127.0.0.1:{epp}") as channel:
            health, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + 120
            while True:
                try:
                    health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
                    break
                except grpc.RpcError:
                    assert router.poll() is None and time.monotonic() < deadline
                    time.sleep(0.2)
        time.sleep(1.0)   # the picker's first read of the engine's /v1/models
        results = run_suite(argparse.Namespace(engine=f"http://127.0.0.1:{port}", model=None, kv_events=events,
                                               kv_replay=f"tcp://127.0.0.1:{replay}", epp=f"127.0.0.1:{epp}"))
        for result in results:
            print(result.status, result.item, result.detail)
        assert [(r.item, r.status, r.detail) for r in results if r.status != "PASS"] == []
