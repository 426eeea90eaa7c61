"""Helpers for tests that run `kubeinfer serve` as a real subprocess on loopback."""

from __future__ import annotations

import subprocess
import time

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
