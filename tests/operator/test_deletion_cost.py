"""Engine pods carry a deletion cost equal to the prompt tokens their prefix cache served, so
a scale-down removes the replica whose cache was worth least; only changed costs are written."""

from __future__ import annotations

import asyncio
from typing import Any

from kubeinfer.operator.gateway.deletion_cost import ANNOTATION, MAX_COST, DeletionCosts, deletion_costs


def pod(name: str, ip: str, cost: str | None = None, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "annotations": {ANNOTATION: cost} if cost else {}}
    if terminating:
        meta["deletionTimestamp"] = "2026-11-25T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]}}


HITS = {"http://10.0.0.1:8000": 5120.0, "http://10.0.0.2:8000": 16.0, "http://10.0.0.3:8000": 1e12}


def test_costs_follow_the_cached_tokens_served_and_skip_unchanged_pods() -> None:
    pods = [pod("hot", "10.0.0.1", "5120"), pod("cold", "10.0.0.2", "900"), pod("huge", "10.0.0.3"),
            pod("unscraped", "10.0.0.4"), pod("leaving", "10.0.0.2", terminating=True)]
    assert deletion_costs(pods, HITS) == {"cold": 16, "huge": MAX_COST}


def test_changed_costs_are_patched_as_annotations() -> None:
    patched: list[tuple[str, dict]] = []

    async def patch(name: str, body: dict) -> None:
        patched.append((name, body))

    costs = DeletionCosts(lambda: [pod("hot", "10.0.0.1"), pod("cold", "10.0.0.2", "16")], lambda: HITS, patch)
    asyncio.run(costs.once())
    assert patched == [("hot", {"metadata": {"annotations": {ANNOTATION: "5120"}}})]
