"""Engine pods carry a deletion cost equal to the prompt tokens their prefix cache served of
late (the engine's decayed `kubeinfer:prefix_cache_hits_recent`), so a scale-down removes the
replica whose cache is worth least now; only changed costs are written."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kubeinfer.server.router.deletion_cost import ANNOTATION, MAX_COST, DeletionCosts, deletion_costs
from kubeinfer.server.engine.stats import DecayingSum

pytestmark = pytest.mark.unit


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


def test_recent_hits_halve_every_half_life_and_count_from_the_next_tick() -> None:
    hits = DecayingSum(half_life=600.0, tick=15.0)
    hits = hits.add(1000, now=3000.0).add(24, now=3014.0)     # one tick: [3000, 3015)
    assert hits.value(3010.0) == 0                            # not settled within its own tick
    assert hits.value(3015.0) == 1024 == hits.value(3029.9)   # every reader of the next tick agrees
    assert hits.value(3015.0 + 600) == 512
    assert hits.value(3015.0 + 6000) == 1024 / 2**10          # idle: keeps decaying without adds
    later = hits.add(100, now=3615.0)
    assert later.value(3630.0) == pytest.approx(512 * 0.5 ** (15 / 600) + 100)
    assert hits.value(3030.0) == pytest.approx(1024 * 0.5 ** (15 / 600))   # immutable: the old snapshot unchanged


def test_a_replica_whose_tenants_left_costs_less_than_one_serving_now() -> None:
    """Cumulative counts would keep the replica that served most since it started; the decayed
    figure prefers the one serving now (10 minutes ago, 3x the tokens; now, 1x)."""
    start = 1_000_000.0
    old = DecayingSum().add(30_000, now=start)
    new = DecayingSum().add(10_000, now=start + 3000)
    now = start + 3015
    values = {"http://10.0.0.1:8000": old.value(now), "http://10.0.0.2:8000": new.value(now)}
    costs = deletion_costs([pod("old", "10.0.0.1"), pod("new", "10.0.0.2")], values)
    assert costs["old"] < costs["new"] == 10_000
