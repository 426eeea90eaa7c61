"""Cache-aware scale-down: engine pods carry `controller.kubernetes.io/pod-deletion-cost`.

A ReplicaSet scaling down deletes the pods with the lowest cost first. The cost of an engine
pod is the prompt tokens its prefix cache served *of late*: the engine's
`kubeinfer:prefix_cache_hits_recent`, hits decayed with a 10-minute half-life, so a
scale-down — by the autoscaler, HPA, KEDA or `kubectl scale` — removes the replica whose cache
is worth least now, not the one that started last nor a random one (a cumulative count would
keep a long-lived replica whose tenants left). The router writes it: it already watches the
pods and reads every engine's `/metrics`; the engine settles the figure on 15 s wall-clock
boundaries, so every router replica writes the same number and none undoes another's patch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterable, Mapping

from ..kube.pods import pod_targets

log = logging.getLogger(__name__)
ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
MAX_COST = 2**31 - 1   # the annotation is an int32


def deletion_costs(pods: Iterable[Mapping[str, Any]], cache_values: Mapping[str, float]) -> dict[str, int]:
    """{pod name: cost} for pods whose annotation should change; `cache_values` by base URL."""
    changes = {}
    for pod, target in zip(pods, pod_targets(pods, path="")):
        if target.url not in cache_values or target.terminating:
            continue
        cost = min(int(cache_values[target.url]), MAX_COST)
        current = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        if current != str(cost):
            changes[target.name] = cost
    return changes


class DeletionCosts:
    """Every `interval` seconds, writes the costs that changed (one merge patch per pod)."""

    def __init__(self, pods: Callable[[], list[dict[str, Any]]], cache_values: Callable[[], Mapping[str, float]],
                 patch: Callable[[str, dict[str, Any]], Awaitable[None]], interval: float = 30.0) -> None:
        self.pods, self.cache_values, self.patch, self.interval = pods, cache_values, patch, interval

    async def once(self) -> None:
        for name, cost in deletion_costs(self.pods(), self.cache_values()).items():
            try:
                await self.patch(name, {"metadata": {"annotations": {ANNOTATION: str(cost)}}})
            except Exception as error:  # noqa: BLE001 - a pod that just went away, API trouble
                log.warning("could not set the deletion cost of pod %s: %s", name, error)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.once()
