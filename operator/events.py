"""Condition transitions → Kubernetes Events (pure), so `kubectl describe` tells the story."""

from __future__ import annotations

from dataclasses import dataclass

from kubeinfer.operator.status import Condition


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def transition_events(before: list[Condition], after: list[Condition]) -> list[Event]:
    """One Event per condition that changed status (or, while Degraded, changed reason)."""
    old = {c.type: c for c in before}
    events = []
    for cond in after:
        prev = old.get(cond.type)
        changed = prev is None or prev.status != cond.status
        if cond.type == "Degraded" and cond.status == "True":
            if changed or prev.reason != cond.reason:  # type: ignore[union-attr]
                events.append(Event("Warning", cond.reason, cond.message))
        elif not changed:
            continue
        elif cond.type == "Degraded" and prev is not None:
            events.append(Event("Normal", "Recovered", "no problems observed any more"))
        elif cond.type == "Ready":
            kind = "Normal" if cond.status == "True" else "Warning"
            if cond.status == "True" or prev is not None:
                events.append(Event(kind, "Ready" if cond.status == "True" else "NotReady",
                                    cond.message))
        elif cond.type == "Progressing" and cond.status == "True":
            events.append(Event("Normal", cond.reason, cond.message))
    return events
