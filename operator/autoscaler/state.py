"""What the autoscaler remembers between ticks, and its round trip through `status.autoscaler`.

Kept in the InferenceService's status rather than in memory so an operator restart (or a new
leader) continues the same averaging window and scale-down clock instead of starting blind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

Point = tuple[float, float]  # (unix time in seconds, value)


@dataclass(frozen=True)
class ScalerState:
    """Recent load sums (the averaging window) and recent proposals (the scale-down period)."""

    loads: tuple[Point, ...] = ()
    proposals: tuple[Point, ...] = ()
    replicas: int | None = None  # spec.replicas seen at the last tick; a change means someone scaled

    def to_status(self) -> dict[str, Any]:
        return {"window": [list(point) for point in self.loads],
                "proposals": [list(point) for point in self.proposals],
                "observedReplicas": self.replicas}

    @classmethod
    def from_status(cls, saved: Mapping[str, Any] | None) -> ScalerState:
        """Restore from status; anything missing or malformed restarts that part empty."""
        if not saved:
            return cls()
        return cls(loads=_points(saved.get("window")), proposals=_points(saved.get("proposals")),
                   replicas=_int_or_none(saved.get("observedReplicas")))


def _points(raw: Any) -> tuple[Point, ...]:
    if not isinstance(raw, list):
        return ()
    return tuple((float(item[0]), float(item[1])) for item in raw
                 if isinstance(item, (list, tuple)) and len(item) == 2
                 and all(isinstance(x, (int, float)) for x in item))


def _int_or_none(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None
