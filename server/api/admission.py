"""Who may enter: requests are refused with 503 + Retry-After while draining or when the
waiting queue is full, so an overloaded pod sheds load fast instead of timing out.

A request with a list of prompts is admitted as one unit, and always onto an empty queue:
a 503 must invite a retry that can succeed, so a batch larger than the queue limit still
runs on an idle server (protocol.MAX_PROMPTS bounds it with a 400)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from ..engine.stats import EngineStats
from .errors import OpenAIError


class Admission:
    def __init__(self, stats: Callable[[], EngineStats], max_queued_requests: int,
                 on_reject: Callable[[str], None]) -> None:
        self.stats, self.max_queued, self.on_reject = stats, max_queued_requests, on_reject
        self.draining = False
        self.in_flight = 0          # HTTP requests admitted and not yet answered
        self._engine_requests = 0   # engine requests they submitted (a prompt list makes several)

    def queued(self) -> int:
        """Waiting requests, counting ones admitted a moment ago the engine has not queued yet."""
        stats = self.stats()
        return max(stats.num_waiting, self._engine_requests - stats.num_running)

    def admit(self, num_engine_requests: int = 1) -> None:
        """Raise a 503 or take a slot; the caller must `release` with the same count."""
        if self.draining:
            self.on_reject("draining")
            raise OpenAIError(503, "server is shutting down; retry on another replica",
                              code="draining", headers={"Retry-After": "5"})
        queued = self.queued()
        if queued > 0 and queued + num_engine_requests > self.max_queued:
            self.on_reject("queue_full")
            raise OpenAIError(503, f"too many requests waiting (limit {self.max_queued}); retry later",
                              code="queue_full", headers={"Retry-After": "1"})
        self.in_flight += 1
        self._engine_requests += num_engine_requests

    def release(self, num_engine_requests: int = 1) -> None:
        self.in_flight -= 1
        self._engine_requests -= num_engine_requests

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, then wait for in-flight requests; True if all finished in time."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0
