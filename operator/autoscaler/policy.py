"""The autoscaling policy of one InferenceService, read from `spec.autoscaling`.

A frozen dataclass rather than the CRD's pydantic model so the decision function stays a pure
function of plain values that tests build in one line; `from_spec` is the only bridge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# metric name in the CRD -> the engine gauges (vLLM names) that are summed for it
METRIC_GAUGES: dict[str, tuple[str, ...]] = {
    "queueDepth": ("vllm:num_requests_waiting",),
    "inFlight": ("vllm:num_requests_waiting", "vllm:num_requests_running"),
    "kvCacheUsage": ("vllm:kv_cache_usage_perc",),
}


@dataclass(frozen=True)
class ScalingPolicy:
    """Bounds and pacing of the built-in autoscaler (camelCase names in the CRD)."""

    min_replicas: int = 1
    max_replicas: int = 3
    metric: str = "queueDepth"
    target: float = 4.0  # per-replica value of the metric the autoscaler aims for
    interval_seconds: float = 10.0
    window_seconds: float = 60.0
    scale_down_delay_seconds: float = 300.0
    max_scale_up_factor: float = 2.0  # step bound: at most ×factor (and +1 from 0) per tick

    def __post_init__(self) -> None:
        if self.metric not in METRIC_GAUGES:
            raise ValueError(f"autoscaling.metric must be one of {sorted(METRIC_GAUGES)}, "
                             f"got {self.metric!r}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling needs 0 <= minReplicas <= maxReplicas, got "
                             f"{self.min_replicas} and {self.max_replicas}")
        if self.target <= 0:
            raise ValueError(f"autoscaling.target must be > 0, got {self.target}")
        if self.interval_seconds <= 0 or self.window_seconds <= 0:
            raise ValueError("autoscaling.intervalSeconds and windowSeconds must be > 0")
        if self.scale_down_delay_seconds < 0:
            raise ValueError("autoscaling.scaleDownDelaySeconds must be >= 0")
        if self.max_scale_up_factor < 1:  # 1 still grows: a step is at least +1
            raise ValueError(f"autoscaling.maxScaleUpFactor must be >= 1, "
                             f"got {self.max_scale_up_factor}")

    @property
    def gauges(self) -> tuple[str, ...]:
        return METRIC_GAUGES[self.metric]

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any]) -> ScalingPolicy:
        """Build from the CRD's `spec.autoscaling` (camelCase); absent fields take the defaults."""
        names = {"min_replicas": "minReplicas", "max_replicas": "maxReplicas",
                 "metric": "metric", "target": "target", "interval_seconds": "intervalSeconds",
                 "window_seconds": "windowSeconds",
                 "scale_down_delay_seconds": "scaleDownDelaySeconds",
                 "max_scale_up_factor": "maxScaleUpFactor"}
        given = {field: autoscaling[key] for field, key in names.items()
                 if autoscaling.get(key) is not None}
        return cls(**given)
