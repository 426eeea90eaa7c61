"""Engine pods carry a deletion cost equal to the prompt tokens their prefix cache served of
late (the engine's decayed `kubeinfer:prefix_cache_hits_recent`), so a scale-down removes the
replica whose cache is worth least now. The operator writes it from the engines' own
`/metrics`; only changed costs are written."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import kopf
import pytest
from test_autoscaler_scrape import engine_app, pod, serving
from test_autoscaler_tick import NAME, NS, POLICY, FakeScaleApi

from kubeinfer.operator.autoscaler import deletion_cost
from kubeinfer.operator.autoscaler.decision import PodSample
from kubeinfer.operator.autoscaler.deletion_cost import ANNOTATION, MAX_COST, RECENT_HITS, deletion_costs, write_costs
from kubeinfer.server.engine.stats import DecayingSum


def annotated(name: str, cost: str | None = None, terminating: bool = False) -> dict[str, Any]:
    found = pod(name, 8000, deleting=terminating)
    found["metadata"]["annotations"] = {ANNOTATION: cost} if cost else {}
    return found


def sample(name: str, value: float | None) -> PodSample:
    return PodSample(name, True, None if value is None else {RECENT_HITS: value})


@pytest.mark.unit
def test_costs_follow_the_cached_tokens_served_and_skip_unchanged_pods() -> None:
    pods = [annotated("hot", "5120"), annotated("cold", "900"), annotated("huge"), annotated("unscraped"),
            annotated("failed"), annotated("leaving", terminating=True)]
    samples = [sample("hot", 5120.0), sample("cold", 16.0), sample("huge", 1e12), sample("failed", None),
               sample("leaving", 3.0)]
    assert deletion_costs(pods, samples) == {"cold": 16, "huge": MAX_COST}


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_replica_whose_tenants_left_costs_less_than_one_serving_now() -> None:
    """Cumulative counts would keep the replica that served most since it started; the decayed
    figure prefers the one serving now (10 minutes ago, 3x the tokens; now, 1x)."""
    start = 1_000_000.0
    old = DecayingSum().add(30_000, now=start)
    new = DecayingSum().add(10_000, now=start + 3000)
    now = start + 3015
    costs = deletion_costs([annotated("old"), annotated("new")],
                           [sample("old", old.value(now)), sample("new", new.value(now))])
    assert costs["old"] < costs["new"] == 10_000


@pytest.mark.unit
def test_every_inference_service_gets_a_deletion_cost_loop() -> None:
    """Not only autoscaled ones: HPA, KEDA and `kubectl scale` scale down too."""
    registry = kopf.OperatorRegistry()
    deletion_cost.register(registry, FakeScaleApi(2, POLICY))
    [daemon] = registry._spawning.get_all_handlers()
    assert daemon.id == "deletion-cost" and daemon.when is None


class PatchedPods(FakeScaleApi):
    """Pod patches land on the stored engine pods (one of them is gone)."""

    async def patch_pod(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        assert namespace == NS
        found = [p for p in self.engines if p["metadata"]["name"] == name]
        if not found:
            raise LookupError(f"pod {name} not found")
        found[0]["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])


def page(hits: float) -> Any:
    return engine_app(f'{RECENT_HITS}{{model_name="m"}} {hits}\nvllm:prefix_cache_hits_total{{model_name="m"}} 9e9\n')


@pytest.mark.integration
def test_the_operator_scrapes_the_engines_and_patches_changed_costs() -> None:
    kube = PatchedPods(2, POLICY)
    with serving(page(5120.0)) as hot, serving(page(16.0)) as cold, serving(page(7.0)) as gone:
        kube.engines = [pod("hot", hot), pod("cold", cold), pod("starting", cold, ready=False)]
        kube.engines[1]["metadata"]["annotations"] = {ANNOTATION: "16"}
        vanished = pod("vanished", gone)   # listed, then deleted before its patch

        async def rounds() -> tuple[dict[str, int], dict[str, int]]:
            listed = kube.list_pods

            async def with_vanished(namespace: str, selector: str) -> list[dict[str, Any]]:
                return [*await listed(namespace, selector), vanished]

            kube.list_pods = with_vanished   # type: ignore[method-assign]
            async with httpx.AsyncClient() as http:
                first = await write_costs(kube, http, NS, NAME)
                kube.list_pods = listed   # type: ignore[method-assign]
                return first, await write_costs(kube, http, NS, NAME)

        first, second = asyncio.run(rounds())
    assert first == {"hot": 5120}   # cold unchanged, starting not Ready, vanished failed alone
    assert second == {}
    costs = {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(ANNOTATION) for p in kube.engines}
    assert costs == {"hot": "5120", "cold": "16", "starting": None}


@pytest.mark.unit
def test_groups_of_pods_per_replica_are_neither_scraped_nor_annotated() -> None:
    """A multi-pod replica is a LeaderWorkerSet group: it scales down by index, so its leaders are
    not scraped a second time (the autoscaler does) and no pod gets a cost nobody reads."""
    kube = PatchedPods(2, POLICY)
    kube.isvc["spec"]["engine"] = {"podsPerReplica": 2}
    listings = []
    with serving(page(5120.0)) as leader:
        kube.engines = [pod("leader-0", leader)]

        async def listed(namespace: str, selector: str) -> list[dict[str, Any]]:
            listings.append(selector)
            return kube.engines

        kube.list_pods = listed   # type: ignore[method-assign]

        async def once() -> dict[str, int]:
            async with httpx.AsyncClient() as http:
                return await write_costs(kube, http, NS, NAME)

        assert asyncio.run(once()) == {}
    assert listings == [] and "annotations" not in kube.engines[0]["metadata"]
