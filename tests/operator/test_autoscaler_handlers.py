"""The kopf wiring: registration, the per-object loop's pacing, Events and resilience."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import kopf
import pytest
from test_autoscaler_scrape import pod, serving
from test_autoscaler_tick import NAME, NS, POLICY, FakeScaleApi, engine

from kubeinfer.operator.autoscaler import handlers

pytestmark = pytest.mark.integration


class StopAfter:
    """Stands in for kopf.DaemonStopped: records each sleep and stops after `ticks` of them."""

    def __init__(self, ticks: int) -> None:
        self.ticks, self.sleeps = ticks, []  # type: ignore[var-annotated]

    def __bool__(self) -> bool:
        return len(self.sleeps) >= self.ticks

    async def wait(self, timeout: float) -> None:
        self.sleeps.append(timeout)


class FlakyScaleApi(FakeScaleApi):
    """The API server is away for the first read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.failures_left = 1

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("apiserver unreachable")
        return await super().get(namespace, name)


def test_register_adds_one_daemon_filtered_on_autoscaling_enabled() -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, FakeScaleApi(1, POLICY))
    daemons = registry._spawning.get_all_handlers()
    assert [d.id for d in daemons] == ["autoscaler"]
    assert handlers.autoscaling_enabled(spec={"autoscaling": {"enabled": True}})
    assert not handlers.autoscaling_enabled(spec={"autoscaling": {"enabled": False}})
    assert not handlers.autoscaling_enabled(spec={})


async def test_loop_survives_a_failed_tick_follows_the_interval_and_posts_scale_events(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "event", lambda body, **event: events.append(event))
    kube = FlakyScaleApi(1, {**POLICY, "intervalSeconds": 3})
    stopped = StopAfter(ticks=3)
    with serving(engine(8)) as port:
        kube.engines = [pod("a", port)]
        async with httpx.AsyncClient() as http:
            await handlers._loop(kube, http, NS, NAME, stopped,  # type: ignore[arg-type]
                                 logging.getLogger("test"))
    assert stopped.sleeps == [10.0, 3.0, 3.0]  # the default until the spec could be read
    assert "autoscaler tick failed" in caplog.text
    assert kube.isvc["spec"]["replicas"] == 4  # 1 -> 2 -> 4 (8 waiting / 2), doubling per tick
    assert [(e["reason"], e["message"][:6]) for e in events] == [("ScaledUp", "1 -> 2"),
                                                                 ("ScaledUp", "2 -> 4")]
    assert all("queueDepth 8.00" in e["message"] and e["type"] == "Normal" for e in events)
