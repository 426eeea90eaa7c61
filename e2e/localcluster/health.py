"""Readiness checks: poll an endpoint until it answers, with a deadline and a useful error."""
from __future__ import annotations

import ssl
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def http_ok(url: str, ca: Path | None = None, token: str | None = None, timeout: float = 2.0) -> bool:
    """True when ``url`` answers 200; HTTPS is verified against ``ca``."""
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(check: Callable[[], bool], what: str, timeout: float, alive: Callable[[], bool] = lambda: True,
               interval: float = 0.2) -> None:
    """Poll ``check``; fail fast if ``alive`` says the process behind it died."""
    deadline = time.monotonic() + timeout
    while not check():
        if not alive():
            raise RuntimeError(f"{what}: the process exited; see its log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(interval)
