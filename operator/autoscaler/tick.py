"""One autoscaler tick for one InferenceService: read, scrape, decide, write.

Everything Kubernetes goes through `ScaleApi`, so this runs unchanged against an in-memory
fake in unit tests and against the API server under kopf.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import httpx

from kubeinfer.server.kube.api import gateway_selector_labels, label_selector
from kubeinfer.server.kube.pods import pod_targets
from kubeinfer.server.kube.scale import Conflict, ScaleApi, engine_selector
from . import metrics
from .decision import RUNNING, Decision, decide
from .policy import ScalingPolicy
from .scrape import scrape
from .state import ScalerState

log = logging.getLogger(__name__)
HELD_GAUGE = "kubeinfer_gateway_held_requests"


@dataclass(frozen=True)
class Tick:
    isvc: dict[str, Any]  # the object as read at the start of the tick (for Events)
    current: int
    decision: Decision
    scaled: bool  # the scale write went through


async def run_tick(kube: ScaleApi, http: httpx.AsyncClient, namespace: str, name: str,
                   now: float | None = None, scrape_timeout: float = 2.0) -> Tick:
    started = time.monotonic()
    now = time.time() if now is None else now
    isvc = await kube.get(namespace, name)
    spec, labels = isvc.get("spec") or {}, (namespace, name)
    policy = ScalingPolicy.from_spec(spec.get("autoscaling") or {})
    current = int(spec.get("replicas", 1))
    targets = pod_targets(await kube.list_pods(namespace, engine_selector(isvc)))
    samples = await scrape(http, targets, (*policy.gauges, RUNNING), scrape_timeout)
    held = await held_requests(kube, http, namespace, name, scrape_timeout)
    state = ScalerState.from_status((isvc.get("status") or {}).get("autoscaler"))
    decision = decide(policy, samples, state, current, now, held,
                      draining=sum(t.terminating for t in targets))
    status: dict[str, Any] = {"desiredReplicas": decision.desired,
                              "autoscaler": decision.to_status()}
    scaled = False
    if decision.desired != current:
        try:
            await kube.set_replicas(namespace, name, decision.desired,
                                    isvc["metadata"].get("resourceVersion"))
            scaled = True
            status["lastScaleTime"] = _rfc3339(now)
            direction = "up" if decision.desired > current else "down"
            metrics.SCALE_EVENTS.labels(*labels, direction).inc()
        except Conflict as error:  # decide again next tick from what changed
            log.info("%s/%s: not scaling this tick: %s", namespace, name, error)
            return Tick(isvc, current, decision, False)
    await kube.patch_status(namespace, name, status)
    metrics.DESIRED_REPLICAS.labels(*labels).set(decision.desired)
    metrics.CURRENT_REPLICAS.labels(*labels).set(current)
    metrics.HELD_REQUESTS.labels(*labels).set(held)
    metrics.SCRAPE_ERRORS.labels(*labels).inc(decision.scrape_failures)
    if decision.average is not None:
        metrics.METRIC_AVERAGE.labels(*labels).set(decision.average)
    metrics.DECISION_SECONDS.observe(time.monotonic() - started)
    return Tick(isvc, current, decision, scaled)


async def held_requests(kube: ScaleApi, http: httpx.AsyncClient, namespace: str, name: str,
                        timeout: float) -> int:
    """Requests waiting in the scale-from-zero gateway's pods; an unreachable gateway adds 0."""
    selector = label_selector(gateway_selector_labels(name))
    samples = await scrape(http, pod_targets(await kube.list_pods(namespace, selector)),
                           (HELD_GAUGE,), timeout)
    return int(sum(s.gauges[HELD_GAUGE] for s in samples if s.gauges is not None))


def _rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
