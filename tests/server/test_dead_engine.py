"""A dead engine loop is visible at once (issue 28): /ready and /health 503, open streams end
with an error event and [DONE], and `kubeinfer serve` exits non-zero for the kubelet to
restart it. The loop is killed with a fault no request can be blamed for: a failed forward pass."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.serve_process import free_port, wait_until_ready

pytestmark = pytest.mark.integration

LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}


class OpenStream:
    """A streaming completion read in a thread until it ends."""

    def __init__(self, url: str) -> None:
        self.lines: list[str] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()
        assert self.first.wait(120), "the stream produced no token"

    def _read(self, url: str) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    self.lines.append(line)
                    self.first.set()

    def ended_with_error(self, code: str) -> bool:
        self.thread.join(30)
        assert not self.thread.is_alive() and self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return json.loads(self.lines[-2].removeprefix("data: "))["error"]["code"] == code


def _status_within(url: str, path: str, status: int, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if httpx.get(url + path).status_code == status:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{path} did not answer {status} within {seconds}s")


def test_a_dead_loop_fails_probes_at_once_and_ends_open_streams(start_server, tiny_model_path) -> None:
    with start_server(tiny_model_path, kv_cache_memory=8 * 2**20, max_model_len=2048) as (url, state):
        stream = OpenStream(url)
        runner = state.engine.engine.runner

        def broken_forward(out):
            raise RuntimeError("device lost")

        runner.run = broken_forward   # the loop thread's next step fails
        assert _status_within(url, "/ready", 503, 1.0) < 1.0
        assert httpx.get(url + "/health").status_code == 503
        assert stream.ended_with_error("engine_dead")
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        assert refused.headers["retry-after"]


# `kubeinfer serve` with a forward pass that fails once the file named by argv[1] exists.
_SERVE_WITH_KILL_SWITCH = """
import os, sys
from kubeinfer.server.engine import model_runner
from kubeinfer.server.cli import main

kill_file, run = sys.argv[1], model_runner.ModelRunner.run

def run_until_killed(self, out):
    if os.path.exists(kill_file):
        raise RuntimeError("device lost")
    return run(self, out)

model_runner.ModelRunner.run = run_until_killed
sys.exit(main(sys.argv[2:]))
"""



def test_serve_exits_non_zero_when_the_loop_dies(tiny_model_path: str, tmp_path: Path) -> None:
    port, kill_file = free_port(), tmp_path / "kill"
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE_WITH_KILL_SWITCH, str(kill_file), "serve", "--model", tiny_model_path,
         "--port", str(port), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8Mi",
         "--max-model-len", "2048", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(process, url, timeout=180)
        stream = OpenStream(url)
        kill_file.touch()
        killed = time.monotonic()
        ready_seen: list[int | str] = []
        while process.poll() is None and time.monotonic() - killed < 1.0:
            try:
                ready_seen.append(httpx.get(url + "/ready", timeout=1).status_code)
            except httpx.TransportError:
                ready_seen.append("closed")
            if ready_seen[-1] != 200:
                break
            time.sleep(0.01)
        assert ready_seen and ready_seen[-1] in (503, "closed"), ready_seen  # not ready within 1 s
        assert stream.ended_with_error("engine_dead")
        assert process.wait(timeout=30) == 1
    finally:
        if process.poll() is None:
            process.kill()
    assert "the engine loop failed" in process.stdout.read()
