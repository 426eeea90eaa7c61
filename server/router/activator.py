"""Pick an engine pod for a request, holding the request while the service wakes from zero.

Which Ready pod is the `Picker`'s choice (`pickers.py`: prefix-aware, least-load, round-robin),
given the request's routing key. Held requests are what makes scale-to-zero safe: nothing is
dropped at zero replicas, the first arrival triggers 0 -> 1, and the wait is bounded so clients
get a 503 they can retry instead of hanging. They wait in the router's queue (`queue.py`),
released by priority and a fair share of tokens across tenants, as they do when every replica
is at its in-flight limit. The held count is exported for the autoscaler, which counts it as load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Collection, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .backends import Backends
from ..fair_share import FairShare
from .pickers import LeastLoad, Picker
from .queue import RequestQueue, Ticket
from .routing_key import RoutingKey

log = logging.getLogger(__name__)


class NoReadyPod(Exception):
    """No engine pod took the request within the activation timeout."""


class QueueFull(NoReadyPod):
    """The queue holds `--max-queued-requests` already: refused at once."""


@dataclass(frozen=True)
class ActivatorConfig:
    activation_timeout: float = 120.0  # spec.autoscaling.activationTimeoutSeconds
    poll_interval: float = 0.5  # how often a held request looks for a Ready pod
    wake_interval: float = 5.0  # at most one 0 -> 1 attempt per this many seconds
    max_in_flight_per_replica: int = 0  # queue beyond this many requests per replica (0: never)
    max_queued_requests: int = 4096  # past this, refuse at once

    def __post_init__(self) -> None:
        if self.max_in_flight_per_replica < 0:
            raise ValueError(f"--max-in-flight-per-replica must be >= 0, got {self.max_in_flight_per_replica}")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")


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
        self.decisions = Counter("kubeinfer:router_decisions", "Routing decisions, by the reason the "
                                 "replica won (prefix, session, affinity, overload, least-load, "
                                 "round-robin, no-key).", ["reason"], registry=self.registry)
        self.warmup_held = Counter("kubeinfer:router_warmup_held_requests", "Requests kept off a replica "
                                   "being warmed with their prefix (sent to another within the bounded "
                                   "load).", registry=self.registry)
        self.in_flight = Gauge("kubeinfer:router_in_flight_requests",
                               "Requests this router has in flight, per engine replica.", ["replica"],
                               registry=self.registry)
        self.retries = Counter("kubeinfer:router_retries", "Requests sent again to another engine replica "
                               "because the one picked first refused the connection (refused) or closed it "
                               "before answering (unanswered); nothing had reached the client.", ["reason"],
                               registry=self.registry)
        token_buckets = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
        self.predicted_cached = Histogram("kubeinfer:router_predicted_cached_tokens",
                                          "Prompt tokens the router expected the chosen replica to "
                                          "have cached.", buckets=token_buckets, registry=self.registry)
        self.actual_cached = Histogram("kubeinfer:router_actual_cached_tokens",
                                       "Prompt tokens the replica reported cached "
                                       "(usage.prompt_tokens_details.cached_tokens).",
                                       buckets=token_buckets, registry=self.registry)
        self.decision_seconds = Histogram("kubeinfer:router_overhead_seconds",
                                          "Time the router spends on a request before forwarding it "
                                          "(parse, tokenize, hash, score), holds excluded.",
                                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01,
                                                   0.025, 0.05, 0.1), registry=self.registry)
        self.warmups = Counter("kubeinfer:router_warmup_requests", "Prefill-only requests warming an engine "
                               "that became Ready with the hottest shared prefixes, by outcome (sent; cached: "
                               "the engine held it already; failed).", ["outcome"], registry=self.registry)
        self.warmup_tokens = Counter("kubeinfer:router_warmup_tokens", "Prompt tokens the engines prefilled "
                                     "for warm-ups (the prompt less what they found cached).", registry=self.registry)


class Activator:
    """The picker's choice among Ready pods (least-loaded by default); when there is none, or
    every one is at `max_in_flight_per_replica`, the request waits in the queue (`queue.py`)."""

    def __init__(self, backends: Backends, config: ActivatorConfig,
                 metrics: GatewayMetrics, picker: Picker | None = None) -> None:
        self.backends, self.config, self.metrics = backends, config, metrics
        self.picker: Picker = picker or LeastLoad()
        self.in_flight: Tally[str] = Tally()
        self.share = FairShare()
        self.queue = RequestQueue(config.max_queued_requests)
        self._last_wake = float("-inf")
        self._changed = asyncio.Event()   # a replica's slot freed or a request queued
        self._dispatcher: asyncio.Task | None = None

    @asynccontextmanager
    async def upstream(self, key: RoutingKey | None = None, exclude: Collection[str] = (),
                       spent: float | None = None, ticket: Ticket = Ticket()) -> AsyncIterator[str]:
        """A pod's base URL for a request with routing `key` (avoiding `exclude`, pods that just
        failed it), counted as in flight until the caller has streamed the answer. `spent`: the
        seconds the caller took to make the key, observed with the pick's own time. `ticket`:
        its tenant, priority and estimated tokens, for the queue's order."""
        self.share.arrived(ticket.tenant)
        try:
            url = await self._acquire(key, exclude, spent, ticket)
            try:
                yield url
            finally:
                self.unhold(url, key)
        finally:
            self.share.departed(ticket.tenant)

    def settle(self, ticket: Ticket, tokens: int) -> None:
        """The request's answer reported `tokens` (prompt and completion): correct its estimate."""
        self.share.charge(ticket.tenant, tokens - ticket.cost)

    def hold(self, url: str) -> None:
        """Count a request sent to `url` as in flight (until `unhold`)."""
        self.in_flight[url] += 1
        self.metrics.in_flight.labels(url).set(self.in_flight[url])

    def unhold(self, url: str, key: RoutingKey | None) -> None:
        self.in_flight[url] -= 1
        self.metrics.in_flight.labels(url).set(self.in_flight[url])
        self.picker.release(url, key)
        if len(self.queue):
            self._changed.set()

    def _open(self, urls: Sequence[str], exclude: Collection[str] = ()) -> list[str]:
        """`urls` not excluded and below the per-replica limit."""
        limit = self.config.max_in_flight_per_replica
        return [url for url in urls if url not in exclude and not (limit and self.in_flight[url] >= limit)]

    def _take(self, urls: Sequence[str], key: RoutingKey | None, ticket: Ticket, spent: float | None) -> str:
        url = self.pick(urls, key, spent)
        self.hold(url)
        self.share.charge(ticket.tenant, ticket.cost)
        return url

    async def _acquire(self, key: RoutingKey | None, exclude: Collection[str], spent: float | None,
                       ticket: Ticket) -> str:
        """A picked pod, already counted in flight."""
        if not len(self.queue):   # else wait behind the queue: it is released in its order
            urls = self._open(await self._ready(), exclude)
            if urls:
                return self._take(urls, key, ticket, spent)
        if self.queue.full:
            raise QueueFull(f"its router's queue is full ({self.config.max_queued_requests} requests waiting)")
        started = time.monotonic()
        waiter = self.queue.add(ticket, key, exclude)
        self.metrics.held.inc()
        self._changed.set()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch())
        released = False
        try:
            await asyncio.wait({waiter.future}, timeout=self.config.activation_timeout)
            released = waiter.future.done()
        finally:
            self.queue.discard(waiter)
            self.metrics.held.dec()
            self.metrics.hold_seconds.observe(time.monotonic() - started)
            if not released and waiter.future.done():   # released as its client went away
                self.unhold(waiter.future.result(), key)
            waiter.future.cancel()
        if not released:
            busy = " (every Ready one is at --max-in-flight-per-replica)" if await self._ready() else ""
            raise NoReadyPod(f"no engine pod took the request within {self.config.activation_timeout:g}s{busy}")
        return waiter.future.result()

    async def _dispatch(self) -> None:
        """Release queued requests in the queue's order while replicas have room; wake the
        service while none is Ready. Runs while anything waits."""
        while len(self.queue):
            self._changed.clear()
            urls = await self._ready()
            if not urls:
                await self._wake()
            try:
                self._release(urls)
            except Exception:   # noqa: BLE001 - a picker's fault must not strand the queue
                log.exception("could not release queued requests")
            if not len(self.queue):
                return
            try:
                await asyncio.wait_for(self._changed.wait(), self.config.poll_interval)
            except asyncio.TimeoutError:
                pass

    def _release(self, ready: Sequence[str]) -> None:
        for waiter in self.queue.order(self.share):
            if not self._open(ready):
                return
            urls = self._open(ready, waiter.exclude)
            if urls and not waiter.future.done():
                waiter.future.set_result(self._take(urls, waiter.key, waiter.ticket, None))
                self.queue.discard(waiter)

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

    def pick(self, urls: Sequence[str], key: RoutingKey | None, spent: float | None = None) -> str:
        """The picker's choice among `urls` (Ready, non-empty), counted in the metrics; `spent`:
        the seconds the caller took to make the key."""
        started = time.perf_counter()
        decision = self.picker.pick(urls, key, self.in_flight)
        if spent is not None:   # not after a hold: that wait is no overhead of routing
            self.metrics.decision_seconds.observe(spent + time.perf_counter() - started)
        self.metrics.decisions.labels(decision.reason).inc()
        if decision.held_off_warming:
            self.metrics.warmup_held.inc()
        if key is not None:
            self.metrics.predicted_cached.observe(decision.predicted_cached_tokens)
        return decision.url
