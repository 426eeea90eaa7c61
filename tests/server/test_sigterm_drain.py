"""SIGTERM on a real `kubeinfer serve` process: readiness fails at once, new requests get
503, in-flight streams complete, and the process exits 0 (the Kubernetes preStop contract)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

import httpx
from helpers.serve_process import wait_until_ready

TOKENS = 150


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    port = _free_port()
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
