"""Observed Deployment + pods → conditions that tell the truth, with the cluster's own words."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

from isvc_builders import CONFIG, crashing_pod, deployment_with, make_isvc, pending_pod, ready_pod
import pytest

from kubeinfer.operator.events import transition_events
from kubeinfer.operator.observe import Observed, observe
from kubeinfer.operator.status import InferenceServiceStatus
from kubeinfer.server import exit_codes

pytestmark = pytest.mark.unit

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


def keda_isvc(spec: dict | None = None, autoscaler_class: str = "keda"):
    return dataclasses.replace(make_isvc(spec), autoscaler_class=autoscaler_class)


def degraded_of(isvc, seen: Observed) -> tuple[str, str, str]:
    status = observe(isvc, seen, CONFIG, InferenceServiceStatus(), NOW)
    c = next(c for c in status.conditions if c.type == "Degraded")
    return c.status, c.reason, c.message


def test_keda_asked_for_on_a_cluster_without_keda_says_how_to_get_it() -> None:
    seen = Observed(deployment_with(1, 1), [], applied_generation=1, keda_installed=False)
    isvc = keda_isvc({"autoscaling": {"enabled": False}})
    status, reason, message = degraded_of(isvc, seen)
    assert (status, reason) == ("True", "AutoscalerUnavailable")
    assert "CustomResourceDefinition scaledobjects.keda.sh not found" in message
    assert "helm install keda kedacore/keda" in message and "spec.autoscaling.enabled: true" in message
    # it does not keep the replicas from serving
    ready = next(c for c in observe(isvc, seen, CONFIG, InferenceServiceStatus(), NOW).conditions
                 if c.type == "Ready")
    assert (ready.status, ready.reason) == ("True", "Available")


def test_keda_installed_is_not_a_problem_but_two_autoscalers_are() -> None:
    seen = Observed(deployment_with(1, 1), [], applied_generation=1, keda_installed=True)
    assert degraded_of(keda_isvc(), seen)[:2] == ("False", "AsExpected")
    status, reason, message = degraded_of(keda_isvc({"autoscaling": {"enabled": True}}), seen)
    assert (status, reason) == ("True", "AutoscalerConflict") and "spec.replicas" in message
    assert degraded_of(keda_isvc(autoscaler_class="hpa"), seen)[1] == "UnknownAutoscalerClass"


def test_keda_unknown_says_nothing() -> None:  # e.g. no RBAC to read CRDs
    seen = Observed(deployment_with(1, 1), [], applied_generation=1, keda_installed=None)
    assert degraded_of(keda_isvc(), seen)[:2] == ("False", "AsExpected")


def test_engine_without_its_device_is_device_unavailable_not_a_bare_crash_loop() -> None:
    pod = crashing_pod()
    pod["status"]["containerStatuses"][0]["lastState"]["terminated"] = {
        "exitCode": exit_codes.DEVICE_UNAVAILABLE,
        "message": "device 'cuda' requested but CUDA is not available (no GPU); use device 'cpu' or 'auto'"}
    seen = Observed(deployment_with(1, 0), [pod], applied_generation=1)
    status = status_of({"engine": {"device": "cuda"}}, seen)
    assert conds(status)["Ready"] == ("False", "DeviceUnavailable")
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.reason == "DeviceUnavailable"
    assert "CUDA is not available (no GPU)" in degraded.message
    assert "set spec.engine.device to cpu or auto" in degraded.message
    events = transition_events([], status.conditions)
    assert any(e.type == "Warning" and e.reason == "DeviceUnavailable" for e in events)


def test_cuda_on_a_cluster_without_gpus_names_the_fix() -> None:
    seen = Observed(deployment_with(1, 0), [pending_pod("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")],
                    applied_generation=1, gpu_products=[], gpus_allocatable=0)
    status = status_of({"engine": {"device": "cuda", "tensorParallelSize": 2}}, seen)
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.reason == "GPUUnavailable"
    assert degraded.message.startswith("engine.device is cuda (2 nvidia.com/gpu per pod) but no node "
                                       "advertises nvidia.com/gpu: set spec.engine.device to cpu or auto")
    assert "Insufficient nvidia.com/gpu" in degraded.message   # the scheduler's words stay
    with_gpus = dataclasses.replace(seen, gpus_allocatable=8)
    assert next(c for c in status_of({"engine": {"device": "cuda"}}, with_gpus).conditions
                if c.type == "Degraded").reason == "Unschedulable"
