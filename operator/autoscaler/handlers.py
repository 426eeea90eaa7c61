"""kopf wiring of the autoscaler: one loop per InferenceService with autoscaling enabled.

A kopf daemon rather than `@kopf.timer`, because a timer's interval is fixed at registration
while ours is per object (`spec.autoscaling.intervalSeconds`) and may be edited live. kopf
stops the daemon when autoscaling is disabled or the object is deleted (it keeps its
finalizer on autoscaled objects for that). `kubeinfer operator` calls `register(registry)`.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import kopf

from kubeinfer.server.kube import api
from kubeinfer.server.kube.scale import ScaleApi
from . import metrics
from .policy import ScalingPolicy
from .tick import Tick, run_tick


def autoscaling_enabled(spec: Any, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def register(registry: kopf.OperatorRegistry, kube: ScaleApi) -> None:
    """Attach the autoscaler daemon to `registry`; `kube` is usually `KubeScaleApi(Kube(...))`."""

    @kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="autoscaler", when=autoscaling_enabled,
                 cancellation_timeout=10.0, registry=registry)
    async def autoscale(namespace: str, name: str, stopped: kopf.DaemonStopped,
                        logger: logging.Logger, **_: Any) -> None:
        async with httpx.AsyncClient() as http:
            try:
                await _loop(kube, http, namespace, name, stopped, logger)
            finally:
                metrics.forget(namespace, name)


async def _loop(kube: ScaleApi, http: httpx.AsyncClient, namespace: str, name: str,
                stopped: kopf.DaemonStopped, logger: logging.Logger) -> None:
    interval = ScalingPolicy().interval_seconds
    while not stopped:
        try:
            tick = await run_tick(kube, http, namespace, name)
            interval = _interval(tick, interval)
            _report(tick, logger)
        except ValueError as error:  # a policy the CRD schema let through
            logger.error("autoscaler paused until the spec is fixed: %s", error)
        except Exception:  # one bad tick must not end the loop; the next one retries
            logger.exception("autoscaler tick failed")
        await stopped.wait(interval)


def _interval(tick: Tick, fallback: float) -> float:
    autoscaling = (tick.isvc.get("spec") or {}).get("autoscaling") or {}
    return float(autoscaling.get("intervalSeconds") or fallback)


def _report(tick: Tick, logger: logging.Logger) -> None:
    """Log every decision; post an Event for every scale, with the numbers that drove it."""
    decision = tick.decision
    logger.debug("autoscaler: %s", decision.reason)
    if tick.scaled:
        logger.info("scaled %d -> %d: %s", tick.current, decision.desired, decision.reason)
        reason = "ScaledUp" if decision.desired > tick.current else "ScaledDown"
        kopf.event(tick.isvc, type="Normal", reason=reason,
                   message=f"{tick.current} -> {decision.desired}: {decision.reason}")
