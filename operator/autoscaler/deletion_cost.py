"""Cache-aware scale-down: engine pods carry `controller.kubernetes.io/pod-deletion-cost`.

A ReplicaSet scaling down deletes the pods with the lowest cost first. The cost of an engine
pod is the prompt tokens its prefix cache served *of late*: the engine's
`kubeinfer:prefix_cache_hits_recent`, hits decayed with a 10-minute half-life, so a
scale-down — by the autoscaler, HPA, KEDA or `kubectl scale` — removes the replica whose cache
is worth least now, not the one that started last nor a random one (a cumulative count would
keep a long-lived replica whose tenants left).

The operator writes it, reading each Ready engine's `/metrics` as the autoscaler does, not the
routers: RBAC selects objects by name, never by label, so a router allowed to patch the
annotation could patch every pod of its namespace (relabel one behind another Service, replace
its image). The operator may patch pods anyway, and it creates the Deployments that run them.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import httpx
import kopf

from kubeinfer.server.kube import api
from kubeinfer.server.kube.pods import pod_targets
from kubeinfer.server.kube.scale import ScaleApi, engine_selector
from .decision import PodSample
from .scrape import scrape

log = logging.getLogger(__name__)
ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
RECENT_HITS = "kubeinfer:prefix_cache_hits_recent"
MAX_COST = 2**31 - 1   # the annotation is an int32
# Twice the engines' 15 s settling tick: each write reflects a settled figure.
INTERVAL_SECONDS = 30.0


def deletion_costs(pods: Sequence[Mapping[str, Any]], samples: Sequence[PodSample]) -> dict[str, int]:
    """{pod name: cost} for the scraped, live pods whose annotation should change."""
    values = {s.pod: s.gauges[RECENT_HITS] for s in samples if s.gauges is not None}
    changes = {}
    for pod, target in zip(pods, pod_targets(pods)):
        if target.name not in values or target.terminating:
            continue
        cost = min(int(values[target.name]), MAX_COST)
        current = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        if current != str(cost):
            changes[target.name] = cost
    return changes


def pods_per_replica(isvc: Mapping[str, Any]) -> int:
    """A replica of more than one pod is a LeaderWorkerSet group, which scales down by group index
    and never reads the annotation: its leaders are left to the autoscaler's own scrape."""
    engine = (isvc.get("spec") or {}).get("engine") or {}
    return int(engine.get("podsPerReplica") or 1)


async def write_costs(kube: ScaleApi, http: httpx.AsyncClient, namespace: str, name: str,
                      scrape_timeout: float = 2.0) -> dict[str, int]:
    """Scrape the InferenceService's engine pods and patch the costs that changed (one merge
    patch per pod); returns what was written (nothing for a multi-pod replica's groups)."""
    isvc = await kube.get(namespace, name)
    if pods_per_replica(isvc) > 1:
        return {}
    pods = await kube.list_pods(namespace, engine_selector(isvc))
    samples = await scrape(http, pod_targets(pods), (RECENT_HITS,), scrape_timeout)
    written = {}
    for pod, cost in deletion_costs(pods, samples).items():
        try:
            await kube.patch_pod(namespace, pod, {"metadata": {"annotations": {ANNOTATION: str(cost)}}})
            written[pod] = cost
        except Exception as error:  # noqa: BLE001 - a pod that just went away, API trouble
            log.warning("could not set the deletion cost of pod %s/%s: %s", namespace, pod, error)
    return written


def register(registry: kopf.OperatorRegistry, kube: ScaleApi) -> None:
    """One loop per InferenceService; `kubeinfer operator` calls this beside the autoscaler's."""

    @kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="deletion-cost", cancellation_timeout=10.0,
                 registry=registry)
    async def deletion_cost(namespace: str, name: str, stopped: kopf.DaemonStopped,
                            logger: logging.Logger, **_: Any) -> None:
        async with httpx.AsyncClient() as http:
            while not stopped:
                try:
                    await write_costs(kube, http, namespace, name)
                except Exception:  # noqa: BLE001 - one bad round must not end the loop
                    logger.exception("writing the engines' deletion costs failed")
                await stopped.wait(INTERVAL_SECONDS)
