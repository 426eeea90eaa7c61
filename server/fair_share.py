"""Priority, then a fair share of tokens across tenants: the order shared by the engine's
scheduler (`engine/scheduling_policy.FairPolicy`) and the router's queue (`router/queue.py`).

A leaf module (stdlib only), so the router orders its waiting requests exactly as the engine
does without importing the engine (or torch).

Virtual-time fair queuing: a tenant's virtual time is the tokens it was given so far, and among
requests of the best priority the tenant furthest behind goes next. A tenant that becomes
active starts at the least active tenant's virtual time, so being idle banks no credit and a
newcomer waits for at most one turn of each busier tenant. Within a tenant, arrival order
stays, so one tenant alone is plain priority-then-arrival order.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Mapping, TypeVar

# Idle tenants whose virtual time is kept (their debt from a recent burst); past this many,
# idle tenants are forgotten, so a gateway naming ever new tenants cannot grow the table.
MAX_IDLE_TENANTS = 1024

Item = TypeVar("Item")
# (priority rank, tie-break such as arrival, item): one tenant's queue holds these in its order
Entry = tuple[int, tuple, Item]


class FairShare:
    """Tokens given per tenant, and the order that shares them fairly."""

    def __init__(self) -> None:
        self.virtual_time: dict[str, float] = {}  # tokens given per tenant, lifted on arrival
        self.active: dict[str, int] = {}  # unfinished requests per tenant
        self.clock = 0.0  # never decreases: the least active virtual time seen

    def _floor(self) -> float:
        if self.active:
            self.clock = max(self.clock, min(self.virtual_time[t] for t in self.active))
        return self.clock

    def arrived(self, tenant: str) -> None:
        """A request of `tenant` starts waiting (it stays active until `departed`)."""
        if tenant not in self.active:
            self.virtual_time[tenant] = max(self.virtual_time.get(tenant, 0.0), self._floor())
        self.active[tenant] = self.active.get(tenant, 0) + 1

    def departed(self, tenant: str) -> None:
        """A request of `tenant` finished, was aborted or refused."""
        count = self.active.get(tenant, 0) - 1
        if count > 0:
            self.active[tenant] = count
            return
        self.active.pop(tenant, None)
        if self.virtual_time.get(tenant, 0.0) <= self._floor():
            self.virtual_time.pop(tenant, None)   # it would be lifted to the floor anyway
        if len(self.virtual_time) - len(self.active) > MAX_IDLE_TENANTS:
            self.virtual_time = {t: v for t, v in self.virtual_time.items() if t in self.active}

    def charge(self, tenant: str, tokens: float) -> None:
        """`tenant` was given `tokens` (negative: a correction of an estimate)."""
        self.virtual_time[tenant] = self.virtual_time.get(tenant, self.clock) + tokens

    def standing(self, tenant: str) -> float:
        """How far ahead `tenant` is: the tokens it was given (the furthest behind goes first)."""
        return self.virtual_time.get(tenant, self.clock)

    def turn(self, heads: Mapping[str, deque[Entry[Item]]]) -> str:
        """The tenant whose queue's head goes next (queues non-empty): the best rank, then the
        tenant furthest behind, then the tie-break (arrival)."""
        return min(heads, key=lambda t: (heads[t][0][0], self.standing(t), heads[t][0][1]))

    def order(self, queues: Mapping[str, deque[Entry[Item]]]) -> Iterator[Item]:
        """Merge per-tenant queues, each already in its order, by `turn`. Standings are read at
        each pick, so what the caller charges meanwhile counts. Consumes the queues."""
        heads = {tenant: queue for tenant, queue in queues.items() if queue}
        while heads:
            tenant = self.turn(heads)
            queue = heads[tenant]
            yield queue.popleft()[2]
            if not queue:
                del heads[tenant]
