"""Helpers for tests that run `kubeinfer serve` as a real subprocess on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx


def wait_until_ready(process: subprocess.Popen, url: str, timeout: float, poll: float = 0.2) -> None:
    """Poll `/ready` until it answers 200; fail with the server's output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.stdout.read() if process.stdout else "server exited"
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(poll)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; reaped either way."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_kubeinfer(args: list[str], port: int, stack: ExitStack) -> subprocess.Popen:
    """`kubeinfer <args> --port <port>` until `stack` closes, once it answers `/ready`; one
    torch thread, so several engines on a small machine do not fight over its cores."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KUBEINFER_LOG_LEVEL": "warning"}
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", *args, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    stack.callback(stop_process, process)
    wait_until_ready(process, f"http://127.0.0.1:{port}", timeout=240)
    return process
