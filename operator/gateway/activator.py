"""Pick an engine pod for a request, holding the request while the service wakes from zero.

Held requests are what makes scale-to-zero safe: nothing is dropped at zero replicas, the
first arrival triggers 0 -> 1, and the wait is bounded so clients get a 503 they can retry
instead of hanging. The held count is exported for the autoscaler, which counts it as load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kubeinfer.operator.gateway.backends import Backends

log = logging.getLogger(__name__)


class NoReadyPod(Exception):
    """No engine pod became Ready within the activation timeout."""


@dataclass(frozen=True)
class ActivatorConfig:
    activation_timeout: float = 120.0  # spec.autoscaling.activationTimeoutSeconds
    poll_interval: float = 0.5  # how often a held request looks for a Ready pod
    wake_interval: float = 5.0  # at most one 0 -> 1 attempt per this many seconds


@dataclass
class GatewayMetrics:
    """Per-process series; a registry of their own so several gateways can share a process."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.held = Gauge("kubeinfer_gateway_held_requests",
                          "Requests waiting for a Ready engine pod.", registry=self.registry)
        self.hold_seconds = Histogram("kubeinfer_gateway_hold_seconds",
                                      "How long held requests waited for a Ready pod.",
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                                      registry=self.registry)
        self.activations = Counter("kubeinfer_gateway_activations",
                                   "0 -> 1 scale-ups triggered by held requests.",
                                   registry=self.registry)
        self.requests = Counter("kubeinfer_gateway_requests", "Requests answered, by status.",
                                ["code"], registry=self.registry)


class Activator:
    """Least-loaded choice among Ready pods (round-robin on ties); holds when there is none."""

    def __init__(self, backends: Backends, config: ActivatorConfig,
                 metrics: GatewayMetrics) -> None:
        self.backends, self.config, self.metrics = backends, config, metrics
        self._in_flight: Tally[str] = Tally()
        self._turn = 0
        self._last_wake = float("-inf")

    @asynccontextmanager
    async def upstream(self) -> AsyncIterator[str]:
        """A pod's base URL, counted as in flight until the caller has streamed the answer."""
        url = await self._acquire()
        self._in_flight[url] += 1
        try:
            yield url
        finally:
            self._in_flight[url] -= 1

    async def _acquire(self) -> str:
        urls = await self._ready()
        if urls:
            return self._pick(urls)
        started = time.monotonic()
        deadline = started + self.config.activation_timeout
        self.metrics.held.inc()
        try:
            while True:
                await self._wake()
                urls = await self._ready()
                if urls:
                    return self._pick(urls)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NoReadyPod(f"no Ready engine pod within "
                                     f"{self.config.activation_timeout:g}s")
                await asyncio.sleep(min(self.config.poll_interval, remaining))
        finally:
            self.metrics.held.dec()
            self.metrics.hold_seconds.observe(time.monotonic() - started)

    async def _wake(self) -> None:
        if time.monotonic() - self._last_wake < self.config.wake_interval:
            return
        self._last_wake = time.monotonic()
        try:
            if await self.backends.wake():
                self.metrics.activations.inc()
        except Exception as error:  # the API may be briefly away: keep holding, retry later
            log.warning("could not scale from zero: %s", error)

    async def _ready(self) -> list[str]:
        try:
            return await self.backends.ready()
        except Exception as error:  # as above: an API hiccup must not fail held requests
            log.warning("could not list engine pods: %s", error)
            return []

    def _pick(self, urls: list[str]) -> str:
        self._turn += 1
        count = len(urls)
        return min(urls, key=lambda u: (self._in_flight[u], (urls.index(u) - self._turn) % count))
