"""A whole autoscaler tick: an in-memory ScaleApi, real engine `/metrics` pages on 127.0.0.1."""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from test_autoscaler_scrape import engine_app, pod, serving

from kubeinfer.server.kube.scale import Conflict
from kubeinfer.operator.autoscaler.tick import run_tick

pytestmark = pytest.mark.integration

NS, NAME = "default", "llm"


def merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 merge patch, as the API server applies it."""
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


class FakeScaleApi:
    """One InferenceService with engine pods and gateway pods, stored like the API server."""

    def __init__(self, replicas: int, autoscaling: dict[str, Any]) -> None:
        self.isvc: dict[str, Any] = {
            "apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS, "resourceVersion": "1"},
            "spec": {"replicas": replicas, "autoscaling": {"enabled": True, **autoscaling}}}
        self.engines: list[dict[str, Any]] = []
        self.gateways: list[dict[str, Any]] = []
        self.conflict_next_write = False

    def _bump(self) -> None:
        meta = self.isvc["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.isvc)

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        assert f"kubeinfer.io/inferenceservice={NAME}" in selector
        return self.gateways if "component=gateway" in selector else self.engines

    async def set_replicas(self, namespace: str, name: str, replicas: int,
                           resource_version: str | None = None) -> None:
        if self.conflict_next_write:
            self.conflict_next_write = False
            self._bump()
        if resource_version and resource_version != self.isvc["metadata"]["resourceVersion"]:
            raise Conflict("changed")
        self.isvc["spec"]["replicas"] = replicas
        self._bump()

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        merge(self.isvc.setdefault("status", {}), status)
        self._bump()


def engine(waiting: float, running: float = 0) -> Any:
    return engine_app(f"vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n"
                      f"vllm:num_requests_running{{model_name=\"m\"}} {running}\n")


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"namespace": NS, "inferenceservice": NAME,
                                            **labels}) or 0.0


POLICY = {"minReplicas": 1, "maxReplicas": 4, "target": 2, "windowSeconds": 30,
          "scaleDownDelaySeconds": 20}


async def test_queue_growth_scales_up_and_records_status_and_metrics() -> None:
    kube = FakeScaleApi(2, POLICY)
    ups = counter("kubeinfer_autoscaler_scale_events_total", direction="up")
    with serving(engine(6)) as a, serving(engine(6)) as b:
        kube.engines = [pod("a", a), pod("b", b)]
        async with httpx.AsyncClient() as http:
            tick = await run_tick(kube, http, NS, NAME, now=1000.0)
    assert tick.scaled and kube.isvc["spec"]["replicas"] == 4  # 12 waiting / 2 = 6, max 4
    status = kube.isvc["status"]
    assert status["desiredReplicas"] == 4 and status["lastScaleTime"] == "1970-01-01T00:16:40Z"
    assert status["autoscaler"]["samples"] == [
        {"time": "1970-01-01T00:16:40.000000Z", "value": 12.0, "pods": 2}]
    assert status["autoscaler"]["averageValue"] == 12.0
    assert counter("kubeinfer_autoscaler_scale_events_total", direction="up") == ups + 1
    assert counter("kubeinfer_autoscaler_desired_replicas") == 4
    assert "scale up 2 -> 4" in tick.decision.reason


async def test_state_survives_through_status_alone_until_the_delayed_scale_down() -> None:
    """Every tick restores from status, exactly what a restarted operator does."""
    kube = FakeScaleApi(2, POLICY)
    with serving(engine(0)) as a, serving(engine(0)) as b:
        kube.engines = [pod("a", a), pod("b", b)]
        async with httpx.AsyncClient() as http:
            replicas = []
            for step in range(5):
                await run_tick(kube, http, NS, NAME, now=1000.0 + 10 * step)
                replicas.append(kube.isvc["spec"]["replicas"])
    assert replicas == [2, 2, 1, 1, 1]  # lower since t=1000, 20 s delay -> down at t=1020
    assert len(kube.isvc["status"]["autoscaler"]["samples"]) == 3  # the 30 s window


async def test_scrape_errors_are_counted_and_do_not_scale_down() -> None:
    kube = FakeScaleApi(2, {**POLICY, "scaleDownDelaySeconds": 0})
    errors = counter("kubeinfer_autoscaler_scrape_errors_total")
    with serving(engine(0)) as a, serving(engine_app("", 503)) as b:
        kube.engines = [pod("a", a), pod("b", b)]
        async with httpx.AsyncClient() as http:
            tick = await run_tick(kube, http, NS, NAME, now=1000.0)
    assert counter("kubeinfer_autoscaler_scrape_errors_total") == errors + 1
    assert kube.isvc["status"]["autoscaler"]["scrapeErrors"] == 1
    assert tick.decision.desired == 1 and kube.isvc["spec"]["replicas"] == 1
    assert tick.decision.average == 2.0  # the unreachable pod counted as one full replica


async def test_a_concurrent_write_wins_and_nothing_is_recorded() -> None:
    kube = FakeScaleApi(1, POLICY)
    kube.conflict_next_write = True
    with serving(engine(9)) as a:
        kube.engines = [pod("a", a)]
        async with httpx.AsyncClient() as http:
            tick = await run_tick(kube, http, NS, NAME, now=1000.0)
    assert not tick.scaled and kube.isvc["spec"]["replicas"] == 1
    assert "status" not in kube.isvc


@pytest.mark.parametrize("held", [0, 3])
async def test_requests_held_by_the_gateway_wake_a_service_at_zero(held: int) -> None:
    kube = FakeScaleApi(0, {**POLICY, "minReplicas": 0})
    with ExitStack() as stack:
        port = stack.enter_context(serving(engine_app(f"kubeinfer_gateway_held_requests {held}\n")))
        kube.gateways = [pod("gw", port)]
        async with httpx.AsyncClient() as http:
            await run_tick(kube, http, NS, NAME, now=1000.0)
    assert kube.isvc["spec"]["replicas"] == (1 if held else 0)
    assert counter("kubeinfer_autoscaler_gateway_held_requests") == held
