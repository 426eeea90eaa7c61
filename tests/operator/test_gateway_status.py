"""Status behind the scale-from-zero gateway: Ready while its Service answers, URL unchanged."""

from __future__ import annotations

from datetime import datetime, timezone

from isvc_builders import CONFIG, crashing_pod, deployment_with, make_isvc, ready_pod
import pytest

from kubeinfer.operator.events import transition_events
from kubeinfer.operator.observe import Observed, observe
from kubeinfer.operator.status import InferenceServiceStatus

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
ZERO = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}}


def step(replicas: int, ready: int, previous: InferenceServiceStatus, pods: list | None = None,
         spec: dict | None = None, gateway: list | None = None) -> InferenceServiceStatus:
    """One observation; the gateway has one Ready pod unless `gateway` says otherwise."""
    seen = Observed(deployment_with(replicas, ready), pods or [], applied_generation=1,
                    gateway_pods=[ready_pod()] if gateway is None else gateway)
    return observe(make_isvc({**(spec or ZERO), "replicas": replicas}), seen, CONFIG, previous,
                   NOW)


def ready(status: InferenceServiceStatus) -> tuple[str, str, str]:
    cond = next(c for c in status.conditions if c.type == "Ready")
    return cond.status, cond.reason, cond.message


def test_idle_then_woken_stays_ready_without_a_not_ready_event() -> None:
    served = step(1, 1, InferenceServiceStatus())
    idle = step(0, 0, served)
    waking = step(1, 0, idle)
    back = step(1, 1, waking)
    assert ready(idle)[:2] == ("True", "ScaledToZero") and "chat-gateway" in ready(idle)[2]
    assert ready(waking) == ("True", "Activating", "0/1 replicas ready; gateway chat-gateway "
                                                   "holds requests until one is")
    assert ready(back)[:2] == ("True", "Available")
    for before, after in ((served, idle), (idle, waking), (waking, back)):
        assert "NotReady" not in [e.reason for e in transition_events(before.conditions,
                                                                      after.conditions)]
    assert {s.url for s in (idle, waking, back)} == {"http://chat.team-a.svc.cluster.local"}
    assert idle.selector == "app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice=chat"


def test_not_ready_before_the_model_was_ever_served() -> None:
    assert ready(step(1, 0, InferenceServiceStatus()))[:2] == ("False", "ReplicasNotReady")


def test_a_broken_engine_is_not_hidden_by_the_gateway() -> None:
    idle = step(0, 0, step(1, 1, InferenceServiceStatus()))
    assert ready(step(1, 0, idle, pods=[crashing_pod()]))[:2] == ("False", "CrashLoopBackOff")


def test_without_the_gateway_waking_is_not_ready() -> None:
    manual = {"autoscaling": {"enabled": False}}
    served = step(1, 1, InferenceServiceStatus(), spec=manual)
    assert ready(step(0, 0, served, spec=manual))[:2] == ("False", "ScaledToZero")
    assert ready(step(1, 0, served, spec=manual))[:2] == ("False", "ReplicasNotReady")


def test_keda_scaling_to_zero_is_ready_behind_the_gateway() -> None:
    keda = {"autoscaling": {"enabled": False, "minReplicas": 0}}
    served = step(1, 1, InferenceServiceStatus(), spec=keda)
    assert ready(step(0, 0, served, spec=keda))[:2] == ("True", "ScaledToZero")


def test_idle_without_a_ready_gateway_is_not_ready_and_says_why() -> None:
    served = step(1, 1, InferenceServiceStatus())
    crashing = step(0, 0, served, gateway=[crashing_pod()])
    assert ready(crashing)[:2] == ("False", "GatewayNotReady")
    assert "gateway chat-gateway has no Ready pod" in ready(crashing)[2]
    assert "CrashLoopBackOff" in ready(crashing)[2]
    degraded = next(c for c in crashing.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "CrashLoopBackOff")


def test_waking_without_a_ready_gateway_is_not_activating() -> None:
    idle = step(0, 0, step(1, 1, InferenceServiceStatus()))
    assert ready(step(1, 0, idle, gateway=[]))[:2] == ("False", "ReplicasNotReady")
