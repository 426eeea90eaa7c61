"""`kubeinfer serve --tensor-parallel-size N` as a real process: it serves the OpenAI client on the
embedded model at TP=3, refuses TP=2 at start naming the head counts, and a killed worker takes it down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from helpers.serve_process import free_port, wait_until_ready

pytestmark = pytest.mark.integration

SERVE = [sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", "embedded", "--dtype", "float32",
         "--device", "cpu", "--kv-cache-memory", "16Mi", "--max-model-len", "256", "--log-level", "info"]



def _workers(pid: int) -> list[int]:
    """Child processes started by multiprocessing's spawn (the TP workers), from any of the
    server's threads (the engine thread starts them)."""
    children = [child for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    return [int(child) for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def tp3_server() -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    process = subprocess.Popen([*SERVE, "--tensor-parallel-size", "3", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url, timeout=300)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_tp3_serves_the_openai_client_on_the_embedded_model(tp3_server):
    process, url = tp3_server
    assert len(_workers(process.pid)) == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0.0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 8


def test_killing_a_worker_fails_health_and_exits_non_zero(tp3_server):
    process, url = tp3_server
    os.kill(_workers(process.pid)[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            healthy = httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            healthy = False
        if not healthy:
            break
        assert time.monotonic() < deadline, "/health still passes 10 s after a worker died"
        time.sleep(0.2)
    assert process.wait(timeout=15) != 0
    log = process.stdout.read()
    assert "parallel worker rank" in log and "died" in log


def test_tp2_on_nine_heads_fails_at_start_naming_the_head_counts():
    result = subprocess.run([*SERVE, "--tensor-parallel-size", "2", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in result.stderr + result.stdout
