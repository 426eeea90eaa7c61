"""Observed Deployment + pods → conditions that tell the truth, with the cluster's own words."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from isvc_builders import CONFIG, crashing_pod, deployment_with, make_isvc, pending_pod, ready_pod

from kubeinfer.operator.events import transition_events
from kubeinfer.operator.observe import Observed, observe
from kubeinfer.operator.status import InferenceServiceStatus

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def conds(status: InferenceServiceStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


def status_of(spec: dict | None, seen: Observed, previous: InferenceServiceStatus | None = None,
              generation: int = 1) -> InferenceServiceStatus:
    return observe(make_isvc(spec, generation=generation), seen, CONFIG,
                   previous or InferenceServiceStatus(), NOW)


def test_before_the_deployment_exists() -> None:
    status = status_of(None, Observed(None, [], applied_generation=1))
    assert conds(status) == {"Ready": ("False", "ReplicasNotReady"),
                             "Progressing": ("True", "Creating"),
                             "Degraded": ("False", "AsExpected")}


def test_ready_when_every_replica_is_up() -> None:
    status = status_of({"replicas": 2}, Observed(deployment_with(2, 2), [], applied_generation=1))
    assert conds(status)["Ready"] == ("True", "Available")
    assert conds(status)["Progressing"] == ("False", "RolloutComplete")
    assert (status.ready_replicas, status.replica_summary, status.observed_generation) == (2, "2/2", 1)
    assert status.selector == "app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice=chat"
    assert status.url == "http://chat.team-a.svc.cluster.local"


def test_spec_edit_is_progressing_while_old_pods_serve() -> None:
    rolling = deployment_with(replicas=2, ready=1, updated=1, generation=2, observed=2)
    status = status_of({}, Observed(rolling, [], applied_generation=2), generation=2)
    assert conds(status)["Ready"] == ("True", "Available")
    assert conds(status)["Progressing"] == ("True", "RollingOut")
    assert status.conditions[0].observed_generation == 2


def test_unschedulable_pods_are_degraded_with_the_scheduler_message() -> None:
    why = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    seen = Observed(deployment_with(1, 0), [pending_pod(why)], applied_generation=1)
    status = status_of({"engine": {"tensorParallelSize": 8}}, seen)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "Unschedulable")
    assert why in degraded.message and "chat-abc" in degraded.message
    assert conds(status)["Ready"] == ("False", "Unschedulable")


def test_missing_gpu_product_names_what_the_cluster_has() -> None:
    seen = Observed(deployment_with(1, 0), [pending_pod("didn't match node selector")],
                    applied_generation=1, gpu_products=["NVIDIA-L4", "NVIDIA-H100", "NVIDIA-L4"])
    status = status_of({"resources": {"gpuProduct": "NVIDIA-B200"}}, seen)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.reason == "GPUProductUnavailable"
    assert degraded.message.startswith("no node has nvidia.com/gpu.product=NVIDIA-B200 "
                                       "(GPU products in the cluster: NVIDIA-H100, NVIDIA-L4)")
    assert "didn't match node selector" in degraded.message


def test_crash_loop_reports_the_last_exit() -> None:
    seen = Observed(deployment_with(1, 0), [crashing_pod()], applied_generation=1)
    degraded = next(c for c in status_of(None, seen).conditions if c.type == "Degraded")
    assert degraded.reason == "CrashLoopBackOff" and "back-off" in degraded.message
    assert "exit code 1 heads not divisible by tp" in degraded.message


def test_progress_deadline_stops_progressing() -> None:
    stuck = deployment_with(1, 0, conditions=[{"type": "Progressing", "status": "False",
                                               "reason": "ProgressDeadlineExceeded",
                                               "message": 'ReplicaSet "chat-1" has timed out'}])
    status = status_of(None, Observed(stuck, [], applied_generation=1))
    assert conds(status)["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert conds(status)["Degraded"] == ("True", "ProgressDeadlineExceeded")


def test_apply_error_is_degraded_and_generation_not_claimed() -> None:
    seen = Observed(deployment_with(1, 1), [], applied_generation=1, error="forbidden: quota")
    status = status_of(None, seen, generation=2)
    assert conds(status)["Degraded"] == ("True", "ReconcileError")
    assert status.observed_generation == 1


def test_scaled_to_zero() -> None:
    seen = Observed(deployment_with(0, 0), [], applied_generation=1)
    assert conds(status_of({"replicas": 0}, seen))["Ready"] == ("False", "ScaledToZero")
    idle = {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0}}
    with_gateway = Observed(deployment_with(0, 0), [], applied_generation=1,
                            gateway_pods=[ready_pod()])
    assert conds(status_of(idle, with_gateway))["Ready"] == ("True", "ScaledToZero")


def test_transition_time_kept_while_status_holds() -> None:
    seen = Observed(deployment_with(1, 1), [], applied_generation=1)
    first = status_of(None, seen)
    later = observe(make_isvc(), seen, CONFIG, first, NOW + timedelta(minutes=5))
    assert [c.last_transition_time for c in later.conditions] == [NOW] * 3
    assert transition_events(first.conditions, later.conditions) == []


def test_events_on_transitions() -> None:
    creating = status_of(None, Observed(None, [], applied_generation=1))
    ready = status_of(None, Observed(deployment_with(1, 1), [], applied_generation=1), creating)
    assert [(e.type, e.reason) for e in transition_events([], creating.conditions)] == \
        [("Normal", "Creating")]
    assert [(e.type, e.reason) for e in transition_events(creating.conditions, ready.conditions)] \
        == [("Normal", "Ready")]
    broken = status_of(None, Observed(deployment_with(1, 0), [pending_pod("no gpu")],
                                      applied_generation=1), ready)
    reasons = [(e.type, e.reason) for e in transition_events(ready.conditions, broken.conditions)]
    assert reasons == [("Warning", "NotReady"), ("Normal", "RollingOut"), ("Warning", "Unschedulable")]


def test_status_names_the_model_id_clients_send() -> None:
    seen = Observed(deployment_with(1, 1), [], applied_generation=1)
    assert status_of(None, seen).served_model_name == "SmolLM2-135M-Instruct"  # embedded, by default
    assert status_of({"model": {"servedName": "chat"}}, seen).served_model_name == "chat"
    assert status_of({"model": {"source": "hf://Qwen/Qwen3-0.6B"}}, seen).served_model_name == "Qwen/Qwen3-0.6B"
    assert status_of({"model": {"source": "pvc://w/llama"}}, seen).served_model_name is None  # the engine names it
