"""kopf wiring of the autoscaler: one loop per InferenceService with autoscaling enabled.

A kopf daemon rather than `@kopf.timer`, because a timer's interval is fixed at registration
while ours is per object (`spec.autoscaling.intervalSeconds`) and may be edited live. kopf
stops the daemon when autoscaling is disabled or the object is deleted (it keeps its
finalizer on autoscaled objects for that). Registered by importing this module.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import kopf

from kubeinfer.operator import api
from kubeinfer.operator.autoscaler import metrics
from kubeinfer.operator.autoscaler.kube import KubeScaleApi, ScaleApi
from kubeinfer.operator.autoscaler.policy import ScalingPolicy
from kubeinfer.operator.autoscaler.tick import Tick, run_tick

_kube: ScaleApi | None = None


def autoscaling_enabled(spec: Any, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="autoscaler", when=autoscaling_enabled,
             cancellation_timeout=10.0)
async def autoscale(namespace: str, name: str, stopped: kopf.DaemonStopped,
                    logger: logging.Logger, **_: Any) -> None:
    global _kube
    _kube = _kube or KubeScaleApi()
    interval = ScalingPolicy().interval_seconds
    async with httpx.AsyncClient() as http:
        try:
            while not stopped:
                try:
                    tick = await run_tick(_kube, http, namespace, name)
                except ValueError as error:  # a policy the CRD schema let through
                    logger.error("autoscaling disabled until the spec is fixed: %s", error)
                except Exception:  # one bad tick must not end the loop; the next retries
                    logger.exception("autoscaler tick failed")
                else:
                    interval = _interval(tick, interval)
                    _report(tick, logger)
                await stopped.wait(interval)
        finally:
            metrics.forget(namespace, name)


def _interval(tick: Tick, fallback: float) -> float:
    autoscaling = (tick.isvc.get("spec") or {}).get("autoscaling") or {}
    return float(autoscaling.get("intervalSeconds") or fallback)


def _report(tick: Tick, logger: logging.Logger) -> None:
    """Log every decision; post an Event for every scale, with the numbers that drove it."""
    decision = tick.decision
    logger.debug("autoscaler: %s", decision.reason)
    if tick.scaled:
        reason = "ScaledUp" if decision.desired > tick.current else "ScaledDown"
        kopf.info(tick.isvc, reason=reason,
                  message=f"{tick.current} -> {decision.desired}: {decision.reason}")
