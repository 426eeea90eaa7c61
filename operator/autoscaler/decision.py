"""metrics → replicas: the pure decision of one autoscaler tick (issue #7's rules).

No clock, no I/O: the handler passes `now`, the samples it scraped and the state it restored
from status, so unit tests replay any history and a restarted operator decides identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from kubeinfer.operator.autoscaler.policy import ScalingPolicy
from kubeinfer.operator.autoscaler.state import Point, ScalerState

RUNNING = "vllm:num_requests_running"  # requests being decoded: their pod must not be cut


@dataclass(frozen=True)
class PodSample:
    """One pod at this tick; `gauges` is None when the pod is Ready but its scrape failed."""

    pod: str
    ready: bool
    gauges: Mapping[str, float] | None = None


@dataclass(frozen=True)
class Decision:
    desired: int
    state: ScalerState
    reason: str  # the numbers that drove it, for the Event and the log
    average: float | None  # the metric's sum over pods, averaged over the window; None on hold
    proposal: int
    scrape_failures: int


def decide(policy: ScalingPolicy, samples: Sequence[PodSample], state: ScalerState,
           current: int, now: float, held_requests: int = 0, draining: int = 0) -> Decision:
    """Desired replicas for this tick plus the state to store for the next one.

    `held_requests` are queued in the scale-from-zero gateway; `draining` counts terminating
    pods still finishing requests from an earlier scale-down (no further step down until done).
    """
    ready = [s for s in samples if s.ready]
    scraped = [s for s in ready if s.gauges is not None]
    failures = len(ready) - len(scraped)
    proposals = list(state.proposals)
    if state.replicas != current:  # first tick, or scaled by someone else (gateway, kubectl):
        proposals.append((now, float(current)))  # that size stands for a full scale-down delay
    if (ready and not scraped) or (current > 0 and not ready):
        why = "no Ready pod could be scraped" if ready else "no pod is Ready yet"
        proposals.append((now, float(current)))
        held_state = ScalerState(state.loads, _recent(proposals, now,
                                 policy.scale_down_delay_seconds), current)
        return Decision(current, held_state, f"hold at {current}: {why} "
                        f"({failures} scrape failures)", None, current, failures)

    load = _tick_load(policy, scraped, failures, held_requests)
    loads = _recent([*state.loads, (now, load)], now, policy.window_seconds)
    average = sum(value for _, value in loads) / len(loads)
    needed = math.ceil(round(average / policy.target, 9))
    if held_requests > 0:
        needed = max(needed, 1)  # a held request needs one pod whatever the metric says
    proposal = min(max(needed, policy.min_replicas), policy.max_replicas)
    proposals = _recent([*proposals, (now, float(proposal))], now,
                        policy.scale_down_delay_seconds)
    busy = sum(1 for s in scraped if _busy(s)) + failures
    desired, verdict = _pace(policy, current, proposal, proposals, busy, draining)
    reason = (f"{policy.metric} {average:.2f} averaged over {len(loads)} samples "
              f"(now {load:.2f} from {len(scraped)}/{len(ready)} Ready pods, {failures} scrape "
              f"failures, {held_requests} held) / target {policy.target:g} -> proposal "
              f"{proposal} [{policy.min_replicas}..{policy.max_replicas}]; {verdict}")
    return Decision(desired, ScalerState(tuple(loads), tuple(proposals), desired), reason,
                    average, proposal, failures)


def _tick_load(policy: ScalingPolicy, scraped: list[PodSample], failures: int,
               held_requests: int) -> float:
    """Sum over scraped pods; a failed pod counts as at least `target`, never as idle."""
    values = [sum(s.gauges.get(g, 0.0) for g in policy.gauges) for s in scraped]  # type: ignore[union-attr]
    imputed = max(sum(values) / len(values), policy.target) if values else policy.target
    queued = held_requests if policy.metric != "kvCacheUsage" else 0
    return sum(values) + failures * imputed + queued


def _pace(policy: ScalingPolicy, current: int, proposal: int, proposals: list[Point],
          busy: int, draining: int) -> tuple[int, str]:
    """Up at once within the step bound; down only to the highest proposal of the delay period."""
    if current > policy.max_replicas or current < policy.min_replicas:
        clamped = min(max(current, policy.min_replicas), policy.max_replicas)
        return clamped, f"clamp {current} -> {clamped} into [min, max]"
    if proposal > current:
        step = max(math.ceil(current * policy.max_scale_up_factor), current + 1)
        desired = min(proposal, step)
        bound = f" (step bound {step})" if desired < proposal else ""
        return desired, f"scale up {current} -> {desired}{bound}"
    highest = int(max(value for _, value in proposals))
    if highest < current and draining:
        return current, f"keep {current}: {draining} pods still draining an earlier scale-down"
    desired = max(highest, busy, policy.min_replicas)
    if desired >= current:
        if highest >= current:
            return current, f"keep {current} (highest proposal in the last " \
                            f"{policy.scale_down_delay_seconds:g}s is {highest})"
        return current, f"keep {current}: {busy} replicas are decoding requests"
    return desired, (f"scale down {current} -> {desired} (every proposal for "
                     f"{policy.scale_down_delay_seconds:g}s was <= {highest}, {busy} busy)")


def _recent(points: list[Point], now: float, period: float) -> list[Point]:
    """Points younger than `period`; the newest is always kept (period 0 = this tick only)."""
    return [(t, v) for t, v in points if t > now - period or t == now]


def _busy(sample: PodSample) -> bool:
    return sample.gauges.get(RUNNING, 0.0) > 0  # type: ignore[union-attr]
