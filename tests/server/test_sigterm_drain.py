"""SIGTERM on a real `kubeinfer serve` process: readiness fails at once, new requests get
503, in-flight streams complete, and the process exits 0 (the Kubernetes preStop contract)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers.serve_process import free_port, wait_until_ready

pytestmark = pytest.mark.integration

TOKENS = 150



def _stream(url: str, first_token: threading.Event, results: list) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
                first_token.set()
    results.append(lines)


def test_sigterm_drains_in_flight_streams_and_exits_zero(tiny_model_path: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", tiny_model_path, "--port", str(port),
         "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8Mi", "--max-model-len", "512",
         "--shutdown-timeout", "60", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(process, url, timeout=180)
        results: list[list[str]] = []
        started = [threading.Event() for _ in range(2)]
        threads = [threading.Thread(target=_stream, args=(url, event, results)) for event in started]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in started)

        process.send_signal(signal.SIGTERM)
        ready = httpx.get(url + "/ready")
        refused = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert ready.status_code == 503
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert refused.headers["retry-after"]

        for thread in threads:
            thread.join(120)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert len(results) == 2
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == TOKENS
        finish = [json.loads(l[6:])["choices"][0]["finish_reason"] for l in lines[:-2]]
        assert finish[-1] == "length"


def _num_waiting(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text.splitlines()
    return float(next(line for line in metrics if line.startswith("vllm:num_requests_waiting{")).split()[-1])


def test_when_the_drain_timeout_expires_open_requests_are_told(tiny_model_path: str) -> None:
    """Streams still open get an error event and [DONE], waiting requests a 503 with Retry-After:
    no client mistakes the cut for a finished answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", tiny_model_path, "--port", str(port),
         "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8Mi", "--max-model-len", "4096",
         "--max-num-seqs", "1", "--shutdown-timeout", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(process, url, timeout=180)
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        waiting: list[httpx.Response] = []
        streamer = threading.Thread(target=stream)
        streamer.start()
        assert started.wait(60)
        waiter = threading.Thread(target=lambda: waiting.append(httpx.post(
            url + "/v1/completions", json={"prompt": "queued", "max_tokens": 4}, timeout=120)))
        waiter.start()
        deadline = time.monotonic() + 30
        while _num_waiting(url) < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)

        process.send_signal(signal.SIGTERM)
        streamer.join(30)
        waiter.join(30)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "shutdown"
    assert len(waiting) == 1 and waiting[0].status_code == 503 and waiting[0].headers["retry-after"]
    assert waiting[0].json()["error"]["code"] == "shutdown"
