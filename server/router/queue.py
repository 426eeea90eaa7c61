"""The router's queue: requests waiting for an engine replica to take them, released by
priority, then by a fair share of tokens across tenants, then by arrival.

A request waits here while the service is at zero (until a replica is Ready) or, with
`--max-in-flight-per-replica`, while every Ready replica has that many of this router's
requests in flight (overload). The order is the engine's (`server/fair_share.py`): the same
classes, so a tenant's burst queued at the router cannot push another tenant's request back
any more than it could in the engine. The queue is bounded (`--max-queued-requests`): past it,
a request is answered 503 with Retry-After at once instead of holding a connection.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Iterator

from ..fair_share import Entry, FairShare
from .routing_key import RoutingKey


@dataclass(frozen=True)
class Ticket:
    """Whose request it is and what it should cost its tenant's share: the estimate (prompt
    bytes / 4 plus the most it may generate) is charged when it is released and corrected from
    its answer's usage (`Activator.settle`)."""

    tenant: str = ""
    priority: int = 0
    cost: int = 0


@dataclass(eq=False)
class Waiter:
    ticket: Ticket
    key: RoutingKey | None
    exclude: Collection[str]
    arrival: int
    future: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RequestQueue:
    """The waiting requests; `order` is the order to release them in."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiters: dict[int, Waiter] = {}   # by arrival: insertion order is arrival order
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        return len(self._waiters) >= self.limit

    def add(self, ticket: Ticket, key: RoutingKey | None, exclude: Collection[str]) -> Waiter:
        waiter = Waiter(ticket, key, exclude, next(self._arrivals))
        self._waiters[waiter.arrival] = waiter
        return waiter

    def discard(self, waiter: Waiter) -> None:
        self._waiters.pop(waiter.arrival, None)

    def order(self, share: FairShare) -> Iterator[Waiter]:
        """Best priority first, then the tenant furthest behind in `share`, then arrival."""
        queues: dict[str, deque[Entry[Waiter]]] = {}
        for waiter in self._waiters.values():
            queues.setdefault(waiter.ticket.tenant, deque()).append(
                (waiter.ticket.priority, (waiter.arrival,), waiter))
        for tenant, queue in queues.items():
            queues[tenant] = deque(sorted(queue, key=lambda entry: entry[:2]))
        return share.order(queues)
