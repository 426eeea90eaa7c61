"""metrics → replicas: the pure decision of one autoscaler tick (issue #7's rules).

No clock, no I/O: the handler passes `now`, the samples it scraped and the state it restored
from status, so unit tests replay any history and a restarted operator decides identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from .policy import ScalingPolicy
from .state import Reading, ScalerState

RUNNING = "vllm:num_requests_running"  # a pod decoding requests is needed: a proposal floor
MAX_READINGS = 720  # status.autoscaler.samples maxItems; 1 s intervals keep the newest 12 min


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
    proposal: int  # clamped to [minReplicas, maxReplicas]
    scrape_failures: int
    needed: int  # ceil(average / target) before the clamp

    def to_status(self) -> dict[str, Any]:
        """`status.autoscaler`; on a hold the last average stays as it was."""
        extra = {} if self.average is None else {"averageValue": round(self.average, 6)}
        return {**self.state.to_status(), **extra, "proposedReplicas": self.needed,
                "scrapeErrors": self.scrape_failures}


def decide(policy: ScalingPolicy, samples: Sequence[PodSample], state: ScalerState,
           current: int, now: float, held_requests: int = 0, draining: int = 0) -> Decision:
    """Desired replicas for this tick plus the state to store for the next one.

    `held_requests` are queued in the scale-from-zero gateway; `draining` counts terminating
    pods still finishing requests from an earlier scale-down (no further step down until done).
    """
    ready = [s for s in samples if s.ready]
    scraped = [s for s in ready if s.gauges is not None]
    failures = len(ready) - len(scraped)
    if state.replicas != current:  # first tick, or scaled by someone else (gateway, kubectl):
        state = replace(state, below_since=None, below_peak=None)  # restart the scale-down clock
    if (ready and not scraped) or (current > 0 and not ready):
        why = "no Ready pod could be scraped" if ready else "no pod is Ready yet"
        bounded = min(max(current, policy.min_replicas), policy.max_replicas)  # bounds still hold
        held = ScalerState(state.readings, None, None, bounded)
        return Decision(bounded, held, f"hold at {current} -> {bounded}: {why} ({failures} "
                        f"scrape failures)", None, bounded, failures, bounded)

    load = _tick_load(policy, scraped, failures, held_requests)
    readings = tuple(r for r in state.readings if r.time > now - policy.window_seconds)
    readings = (*readings, Reading(now, load, len(scraped)))[-MAX_READINGS:]
    average = sum(r.value for r in readings) / len(readings)
    needed = math.ceil(round(average / policy.target, 9))
    if held_requests > 0:
        needed = max(needed, 1)  # a held request needs one pod whatever the metric says
    # Never propose fewer replicas than are decoding: with a shallow queue spread over busy
    # pods the queue alone would propose too few, and the scale-down clock would run under load.
    busy = sum(1 for s in scraped if _gauge(s, RUNNING) > 0) + failures
    proposal = min(max(needed, busy, policy.min_replicas), policy.max_replicas)
    desired, verdict, state = _pace(policy, state, current, proposal, now, draining)
    reason = (f"{policy.metric} {average:.2f} averaged over {len(readings)} samples "
              f"(now {load:.2f} from {len(scraped)}/{len(ready)} Ready pods, {failures} scrape "
              f"failures, {held_requests} held) / target {policy.target:g} = {needed}, "
              f"{busy} decoding -> proposal {proposal} [{policy.min_replicas}.."
              f"{policy.max_replicas}]; {verdict}")
    return Decision(desired, replace(state, readings=readings, replicas=desired), reason,
                    average, proposal, failures, needed)


def _tick_load(policy: ScalingPolicy, scraped: list[PodSample], failures: int,
               held_requests: int) -> float:
    """Sum over scraped pods; a failed pod counts as at least `target`, never as idle."""
    values = [sum(_gauge(s, g) for g in policy.gauges) for s in scraped]
    imputed = max(sum(values) / len(values), policy.target) if values else policy.target
    queued = held_requests if policy.metric != "kvCacheUsage" else 0
    return sum(values) + failures * imputed + queued


def _gauge(sample: PodSample, name: str) -> float:
    return (sample.gauges or {}).get(name, 0.0)


def _pace(policy: ScalingPolicy, state: ScalerState, current: int, proposal: int, now: float,
          draining: int) -> tuple[int, str, ScalerState]:
    """Up at once within the step bound; down only after the delay, to the period's peak."""
    if current > policy.max_replicas or current < policy.min_replicas:
        clamped = min(max(current, policy.min_replicas), policy.max_replicas)
        return clamped, f"clamp {current} -> {clamped} into [min, max]", replace(
            state, below_since=None, below_peak=None)
    if proposal >= current:
        state = replace(state, below_since=None, below_peak=None)
        if proposal == current:
            return current, f"keep {current}", state
        step = max(math.ceil(current * policy.max_scale_up_factor), current + 1)
        desired = min(proposal, step)
        bound = f" (step bound {step})" if desired < proposal else ""
        return desired, f"scale up {current} -> {desired}{bound}", state
    since = now if state.below_since is None else state.below_since
    peak = proposal if state.below_peak is None else max(state.below_peak, proposal)
    state = replace(state, below_since=since, below_peak=peak)
    lower_for = now - since
    if lower_for < policy.scale_down_delay_seconds:
        return current, (f"keep {current}: proposals lower for {lower_for:.0f}s of "
                         f"{policy.scale_down_delay_seconds:g}s (peak {peak})"), state
    if draining:
        return current, f"keep {current}: {draining} pods still draining", state
    return peak, (f"scale down {current} -> {peak} (every proposal for {lower_for:.0f}s was "
                  f"<= {peak})"), replace(state, below_since=None, below_peak=None)
