"""Which waiting sequence the scheduler admits next and which running one gives way: the
scheduler's seam for priorities and tenants (`Scheduler(..., policy=...)`).

`PriorityPolicy`, the default, is the order the scheduler keeps its queues in: priority
(lower first), then arrival. It costs the step nothing beyond that order.

`FairPolicy` keeps priority first and, among requests of one priority, shares computed tokens
(prompt and generated, as the step computes them) fairly among tenants: the virtual-time fair
queuing of `server/fair_share.py`, which the router's queue shares. One tenant alone is
exactly `PriorityPolicy`'s order.

When every slot (`max_num_seqs`) is taken, `FairPolicy` also lets a waiting request of a tenant
running at least two fewer sequences than another take the place of that tenant's newest
running one (of no better priority), which is preempted and recomputed later from the prefix
cache: a tenant holding every slot cannot keep a newcomer waiting for one of its requests to
end, and since each such swap narrows the gap, two tenants never trade a slot back and forth.

With `aging_seconds`, a waiting request's priority improves by one level per that many
seconds it has waited, so a low-priority request is never starved: after
`(its priority - the best priority) * aging_seconds` it competes in the top band.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Iterable, Protocol

from ..fair_share import Entry, FairShare
from .sequence import Request, Sequence


class SchedulingPolicy(Protocol):
    def arrived(self, request: Request) -> None:
        """A new request entered the waiting queue (not a preempted one coming back)."""

    def departed(self, request: Request) -> None:
        """The request's last sequence finished or was aborted."""

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` of `seq` are computed in this step."""

    def admission_order(self, waiting: list[Sequence]) -> Iterable[Sequence]:
        """Waiting sequences in the order to try admitting them (a snapshot: the scheduler
        removes admitted ones from `waiting` while iterating)."""

    def preemption_order(self, running: list[Sequence]) -> Iterable[Sequence]:
        """Running sequences, the first to give way first."""

    def displacement(self, waiting: list[Sequence], running: list[Sequence]) -> tuple[Sequence, Sequence] | None:
        """Called when every slot is taken and some sequence waits: (a waiting sequence to start
        now, the running one to preempt for it), or None to wait for a slot to free."""


class PriorityPolicy:
    """Priority, then arrival: the order `Sequence.sort_key` keeps both queues in."""

    def arrived(self, request: Request) -> None:
        pass

    def departed(self, request: Request) -> None:
        pass

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def admission_order(self, waiting: list[Sequence]) -> Iterable[Sequence]:
        return waiting[:]

    def preemption_order(self, running: list[Sequence]) -> Iterable[Sequence]:
        return reversed(running)

    def displacement(self, waiting: list[Sequence], running: list[Sequence]) -> tuple[Sequence, Sequence] | None:
        return None


class FairPolicy:
    """Priority, then tokens fairly shared among tenants (`Request.tenant`), then arrival."""

    def __init__(self, aging_seconds: float | None = None) -> None:
        self.aging_seconds = aging_seconds
        self.share = FairShare()

    def arrived(self, request: Request) -> None:
        self.share.arrived(request.tenant)

    def departed(self, request: Request) -> None:
        self.share.departed(request.tenant)

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        self.share.charge(seq.request.tenant, num_tokens)

    def _rank(self, seq: Sequence, now: float) -> int:
        priority = seq.request.params.priority
        if self.aging_seconds:
            priority -= int((now - seq.request.metrics.arrival_time) / self.aging_seconds)
        return priority

    def _queues(self, waiting: list[Sequence]) -> dict[str, deque[Entry[Sequence]]]:
        """Each tenant's waiting sequences with their ranks, in the order it admits them."""
        now = time.monotonic()
        queues: dict[str, list[Sequence]] = {}
        for seq in waiting:
            queues.setdefault(seq.request.tenant, []).append(seq)
        heads: dict[str, deque[Entry[Sequence]]] = {}
        for tenant, seqs in queues.items():
            ranked = [(self._rank(seq, now), seq.sort_key[1:], seq) for seq in seqs]
            if self.aging_seconds:   # aging can reorder a tenant's own queue
                ranked.sort(key=lambda entry: entry[:2])
            heads[tenant] = deque(ranked)
        return heads

    def admission_order(self, waiting: list[Sequence]) -> Iterable[Sequence]:
        # NOTE: standings are read at each pick: the scheduler charges what it admits.
        return self.share.order(self._queues(waiting))

    def preemption_order(self, running: list[Sequence]) -> Iterable[Sequence]:
        """Worst priority first, then the tenant furthest ahead, then the newest."""
        return sorted(running, reverse=True, key=lambda seq: (
            seq.request.params.priority, self.share.standing(seq.request.tenant),
            seq.sort_key[1:]))

    def displacement(self, waiting: list[Sequence], running: list[Sequence]) -> tuple[Sequence, Sequence] | None:
        """Tenants' next waiting sequences in admission order: the first that finds a running one,
        in preemption order, of no better priority whose tenant runs at least two more sequences
        than its own takes that one's place (see the module docstring)."""
        running_per_tenant = Counter(seq.request.tenant for seq in running)
        most = max(running_per_tenant.values(), default=0)
        heads = self._queues(waiting)
        while heads:
            tenant = self.share.turn(heads)
            _, _, candidate = heads.pop(tenant)[0]
            enough = running_per_tenant[tenant] + 2
            if enough > most:
                continue
            for seq in self.preemption_order(running):
                if seq.request.params.priority < candidate.request.params.priority:
                    break   # the rest have better priorities still
                if running_per_tenant[seq.request.tenant] >= enough:
                    return candidate, seq
        return None


def build_policy(name: str, aging_seconds: float | None = None) -> SchedulingPolicy:
    """`--scheduling-policy` (validated by EngineConfig): auto and priority are `PriorityPolicy`,
    fair is `FairPolicy`."""
    return FairPolicy(aging_seconds) if name == "fair" else PriorityPolicy()
