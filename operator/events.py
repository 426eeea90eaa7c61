"""Condition transitions → Kubernetes Events (pure), so `kubectl describe` tells the story."""

from __future__ import annotations

from dataclasses import dataclass

from .status import Condition


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def transition_events(before: list[Condition], after: list[Condition]) -> list[Event]:
    """One Event per condition that changed status (or, while Degraded, changed reason).

    The first status ever written only reports what is worth knowing: a rollout starting or
    a problem; "not ready yet" and "not degraded" are the expected start.
    """
    old = {c.type: c for c in before}
    events = []
    for cond in after:
        prev, is_true = old.get(cond.type), cond.status == "True"
        if cond.type == "AdaptersReady":
            events += adapter_events(prev, cond)
            continue
        if prev is not None and prev.status == cond.status and \
                not (cond.type == "Degraded" and is_true and prev.reason != cond.reason):
            continue
        if cond.type == "Degraded" and is_true:
            events.append(Event("Warning", cond.reason, cond.message))
        elif cond.type == "Degraded" and prev is not None:
            events.append(Event("Normal", "Recovered", "no problems observed any more"))
        elif cond.type == "Ready" and is_true:
            events.append(Event("Normal", "Ready", cond.message))
        elif cond.type == "Ready" and prev is not None:
            events.append(Event("Warning", "NotReady", cond.message))
        elif cond.type == "Progressing" and is_true:
            events.append(Event("Normal", cond.reason, cond.message))
    return events


def adapter_events(prev: Condition | None, cond: Condition) -> list[Event]:
    """A Warning for each new adapter failure (a retry failing the same way stays quiet), and
    the all-clear after one; waiting for pods or loads to finish is the expected start."""
    failed = cond.reason == "AdapterLoadFailed"
    was_failing = prev is not None and prev.reason == "AdapterLoadFailed"
    if failed and not (was_failing and prev is not None and prev.message == cond.message):
        return [Event("Warning", cond.reason, cond.message)]
    if cond.status == "True" and was_failing:
        return [Event("Normal", cond.reason, cond.message)]
    return []
