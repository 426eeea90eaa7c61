"""What the autoscaler remembers between ticks, and its round trip through `status.autoscaler`.

Kept in the InferenceService's status rather than in memory so an operator restart (or a new
leader) continues the same averaging window and scale-down clock instead of starting blind.
The scale-down period is two numbers (since when, highest proposal since) rather than a list
of proposals, so a long delay with a short interval still fits in a status object.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping


@dataclass(frozen=True)
class Reading:
    """The metric summed over the pods of one tick."""

    time: float  # unix seconds
    value: float
    pods: int  # pods scraped successfully


@dataclass(frozen=True)
class ScalerState:
    """The averaging window and the scale-down clock."""

    readings: tuple[Reading, ...] = ()
    below_since: float | None = None  # proposals have stayed below the replicas since then...
    below_peak: int | None = None  # ...and this was the highest of them: where scale-down goes
    replicas: int | None = None  # spec.replicas at the last tick; a change means someone scaled

    def to_status(self) -> dict[str, Any]:
        """camelCase fields of `status.autoscaler`; None clears a field in a merge patch."""
        return {"samples": [{"time": _rfc3339(r.time), "value": r.value, "pods": r.pods}
                            for r in self.readings],
                "belowSince": None if self.below_since is None else _rfc3339(self.below_since),
                "belowPeak": self.below_peak, "observedReplicas": self.replicas}

    @classmethod
    def from_status(cls, saved: Mapping[str, Any] | None) -> ScalerState:
        """Restore; a missing or malformed part restarts empty, which only delays a scale-down."""
        if not isinstance(saved, Mapping):
            return cls()
        readings = tuple(r for r in map(_reading, saved.get("samples") or []) if r is not None)
        below_since, below_peak = _time(saved.get("belowSince")), _count(saved.get("belowPeak"))
        if below_since is None or below_peak is None:
            below_since = below_peak = None
        return cls(readings, below_since, below_peak, _count(saved.get("observedReplicas")))


def _rfc3339(unix: float) -> str:
    moment = datetime.fromtimestamp(unix, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _time(raw: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _count(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None


def _reading(raw: Any) -> Reading | None:
    if not isinstance(raw, Mapping):
        return None
    moment, value, pods = _time(raw.get("time")), raw.get("value"), _count(raw.get("pods"))
    if moment is None or pods is None or not isinstance(value, (int, float)):
        return None
    return Reading(moment, float(value), pods)
