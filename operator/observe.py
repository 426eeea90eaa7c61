"""Observed Deployment + pods → InferenceService status and conditions (pure).

Ready means "at least one engine answers" — or, behind the scale-from-zero gateway, "the
Service answers": at zero replicas, and while a request wakes an engine once the model has
been served before (the gateway holds it). Progressing means "a rollout is in flight";
Degraded means "something needs a human" — a scheduler refusal, a crash loop, an image pull
failure, a rejected apply — and its message says why in the cluster's own words.
AdaptersReady (only with LoRA on) means every Ready replica holds every spec.adapters entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubeinfer.server import exit_codes
from kubeinfer.server.kube.pods import pod_ready

from . import api
from .adapters import AdapterReport, adapter_condition, adapter_status
from .build import GPU_RESOURCE, device, gpus_per_pod
from .inference_pool import POOL_CRD, picker_name
from .model_source import model_mounts
from .resource import InferenceService, OperatorConfig
from .router_build import gateway_name, scales_from_zero
from .status import Condition, InferenceServiceStatus

STUCK_WAITING_REASONS = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull",
                         "CreateContainerConfigError", "CreateContainerError", "InvalidImageName"}
MAX_MESSAGE = 1000


@dataclass(frozen=True)
class Observed:
    """What the handlers read from the API for one InferenceService."""

    deployment: dict[str, Any] | None
    pods: list[dict[str, Any]]
    applied_generation: int | None  # the spec generation whose children were applied
    error: str | None = None  # why applying failed, if it did
    gpu_products: list[str] | None = None  # node GPU products, looked up when pods are stuck
    gpus_allocatable: int | None = None  # nvidia.com/gpu over all nodes, looked up with gpu_products
    gateway_pods: list[dict[str, Any]] = field(default_factory=list)  # at minReplicas 0
    adapters: AdapterReport | None = None  # the Ready engines' LoRA adapters after a sync
    keda_installed: bool | None = None  # looked up when the autoscaler class is keda; None: unknown
    worker_pods: list[dict[str, Any]] = field(default_factory=list)  # multi-pod replicas' workers
    lws_missing: bool = False  # multi-pod replicas asked for on a cluster without the LeaderWorkerSet CRD
    model_error: tuple[str, str] | None = None  # (reason, message): the source could not be resolved
    pool_crd_missing: bool = False  # spec.inferencePool on a cluster without GIE's InferencePool CRD


def lws_as_workload(lws: dict[str, Any]) -> dict[str, Any]:
    """A LeaderWorkerSet in a Deployment's terms, a group counting as one replica: its status
    counts groups (readyReplicas: groups whose every pod is Ready) and has no observedGeneration
    or availableReplicas."""
    status = lws.get("status") or {}
    ready = status.get("readyReplicas", 0)
    return {**lws, "status": {"observedGeneration": lws["metadata"].get("generation", 0),
                              "replicas": status.get("replicas", 0), "readyReplicas": ready,
                              "updatedReplicas": status.get("updatedReplicas", 0), "availableReplicas": ready}}


def lws_missing_problem(isvc: InferenceService) -> tuple[str, str]:
    return ("LeaderWorkerSetMissing",
            f"engine.podsPerReplica {isvc.spec.engine.pods_per_replica} makes each replica a LeaderWorkerSet group, "
            f"but the cluster has no CustomResourceDefinition {api.LWS_CRD}: install LeaderWorkerSet "
            f"({api.LWS_INSTALL}) or set engine.podsPerReplica to 1")


def pool_crd_problems(isvc: InferenceService, missing: bool) -> list[tuple[str, str]]:
    """spec.inferencePool without GIE's CRD: the engines serve, but no gateway can route to a pool."""
    if not missing:
        return []
    return [("InferencePoolCRDMissing",
             f"spec.inferencePool.enabled, but the cluster has no CustomResourceDefinition {POOL_CRD}, so no "
             f"InferencePool was created (the picker {picker_name(isvc)} runs): install the Gateway API Inference "
             f"Extension's CRDs ({api.GIE_INSTALL}) or set spec.inferencePool.enabled to false")]


def gpu_problems(isvc: InferenceService, gpus_allocatable: int | None) -> list[tuple[str, str]]:
    """GPUs asked for on a cluster whose nodes advertise none: the scheduler only says 'Insufficient'."""
    if gpus_allocatable != 0 or device(isvc) != "cuda" or isvc.spec.resources.gpu_product:  # that one says more
        return []
    return [("GPUUnavailable", f"engine.device is cuda ({gpus_per_pod(isvc)} "
                               f"{GPU_RESOURCE} per pod) but no node advertises {GPU_RESOURCE}: set "
                               "spec.engine.device to cpu or auto (auto is cpu unless resources.gpuProduct "
                               "names a GPU), or add GPU nodes with the NVIDIA device plugin")]


def gpu_product_problems(wanted: str | None, available: list[str] | None) -> list[tuple[str, str]]:
    """A GPU product no node has: say so, and what the cluster does have."""
    if not wanted or available is None or wanted in available:
        return []
    have = ", ".join(sorted(set(available))) or "none"
    return [("GPUProductUnavailable", f"no node has nvidia.com/gpu.product={wanted} "
                                      f"(GPU products in the cluster: {have})")]


def autoscaler_problems(isvc: InferenceService, keda_installed: bool | None) -> list[tuple[str, str]]:
    """An autoscaler class that cannot scale this service: KEDA missing, or two autoscalers at once.

    Without KEDA's CRDs the ScaledObject never got past `kubectl apply`, so nothing but this
    condition tells the service's owner that nobody will scale it.
    """
    wanted, annotation = isvc.autoscaler_class, api.AUTOSCALER_CLASS_ANNOTATION
    if wanted is None:
        return []
    if wanted != "keda":
        return [("UnknownAutoscalerClass", f"annotation {annotation}={wanted!r} is not a known autoscaler "
                                           "class: use keda, or remove it and set spec.autoscaling.enabled "
                                           "for the built-in autoscaler")]
    problems = []
    if keda_installed is False:
        problems.append(("AutoscalerUnavailable", f"annotation {annotation}=keda, but the cluster has no KEDA "
                         f"(CustomResourceDefinition {api.KEDA_CRD} not found), so no ScaledObject can scale "
                         "this service: install KEDA (helm install keda kedacore/keda -n keda "
                         "--create-namespace) and apply its ScaledObject (crds/examples/keda-scaledobject.yaml), "
                         f"or remove the annotation and set spec.autoscaling.enabled: true for the built-in "
                         "autoscaler"))
    if isvc.spec.autoscaling.enabled:
        problems.append(("AutoscalerConflict", f"annotation {annotation}=keda and spec.autoscaling.enabled: "
                         "both KEDA and the built-in autoscaler would set spec.replicas; set "
                         "spec.autoscaling.enabled: false, or remove the annotation"))
    return problems


def pod_problems(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(reason, message) for pods stuck in a way that waiting will not fix."""
    problems: list[tuple[str, str]] = []
    for pod in pods:
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                problems.append(("Unschedulable", f"pod {name} cannot be scheduled: "
                                                  f"{cond.get('message', '')}".strip()))
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_WAITING_REASONS:
                last = ((cs.get("lastState") or {}).get("terminated") or {})
                # The engine's own last words (its log tail, via FallbackToLogsOnError) say
                # why, e.g. a tensorParallelSize that does not divide the attention heads.
                exit_code = f"exit code {last['exitCode']}" if "exitCode" in last else ""
                detail = " ".join(filter(None, [exit_code, _last_words(last.get("message") or ""),
                                                waiting.get("message", "")]))
                if last.get("exitCode") == exit_codes.DEVICE_UNAVAILABLE:  # restarts cannot help
                    problems.append(("DeviceUnavailable", f"pod {name} container {cs['name']}: the engine "
                                     f"cannot use its device ({detail}); set spec.engine.device to cpu or "
                                     "auto, or run on nodes whose GPUs the container runtime exposes"))
                    continue
                if last.get("exitCode") in exit_codes.REASONS:  # e.g. the fetch: ModelNotFound, ModelCacheFull
                    problems.append((exit_codes.REASONS[last["exitCode"]],
                                     f"pod {name} container {cs['name']}: {detail}"))
                    continue
                problems.append((waiting["reason"], f"pod {name} container {cs['name']}: "
                                                    f"{waiting['reason']} {detail}".strip()))
    return problems


def _last_words(message: str, lines: int = 3) -> str:
    """The end of a termination message: a log tail's last lines hold the error (a traceback's last)."""
    tail = [line.strip() for line in message.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(tail)[-500:]


def deployment_problems(deployment: dict[str, Any]) -> list[tuple[str, str]]:
    problems = []
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        failed = (cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded") \
            or (cond.get("type") == "ReplicaFailure" and cond.get("status") == "True")
        if failed:
            problems.append((cond.get("reason") or cond["type"], cond.get("message", "")))
    return problems


def rollout_in_flight(deployment: dict[str, Any], desired: int) -> bool:
    status = deployment.get("status") or {}
    caught_up = status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    updated = status.get("updatedReplicas", 0)
    return not caught_up or updated < desired or status.get("replicas", 0) > updated \
        or status.get("availableReplicas", 0) < desired


def conditions(isvc: InferenceService, seen: Observed, ready: int,
               was_ready: bool = False) -> list[tuple[str, bool, str, str]]:
    """(type, status, reason, message) for Ready, Progressing and Degraded."""
    desired, gateway = isvc.spec.replicas, scales_from_zero(isvc)
    problems = ([seen.model_error] if seen.model_error else []) \
        + ([("ReconcileError", seen.error)] if seen.error else []) \
        + gpu_problems(isvc, seen.gpus_allocatable) \
        + gpu_product_problems(isvc.spec.resources.gpu_product, seen.gpu_products) \
        + pod_problems(seen.pods) + pod_problems(seen.worker_pods) + pod_problems(seen.gateway_pods)
    if seen.lws_missing:
        problems.insert(0, lws_missing_problem(isvc))
    gateway_up = gateway and any(pod_ready(p) for p in seen.gateway_pods)
    if seen.deployment is not None:
        problems += deployment_problems(seen.deployment)
    problem_text = "; ".join(dict.fromkeys(m for _, m in problems))[:MAX_MESSAGE]
    if desired == 0 and gateway and not gateway_up:  # nothing would answer the next request
        ready_c = (False, "GatewayNotReady", f"no replicas while idle and gateway "
                   f"{gateway_name(isvc)} has no Ready pod" +
                   (f": {problem_text}" if problem_text else ""))
    elif desired == 0:
        ready_c = (gateway, "ScaledToZero",
                   f"no replicas while idle; gateway {gateway_name(isvc)} holds the next "
                   "request and scales up" if gateway else "spec.replicas is 0")
    elif ready > 0:
        ready_c = (True, "Available", f"{ready}/{desired} replicas ready")
    elif gateway_up and was_ready and not problems:  # waking from zero: not an outage
        ready_c = (True, "Activating", f"0/{desired} replicas ready; gateway "
                                       f"{gateway_name(isvc)} holds requests until one is")
    else:
        reason = problems[0][0] if problems else "ReplicasNotReady"
        ready_c = (False, reason, f"0/{desired} replicas ready" +
                   (f": {problem_text}" if problem_text else ""))
    if seen.lws_missing:
        progressing = (False, *lws_missing_problem(isvc))
    elif seen.deployment is None:
        progressing = (True, "Creating", f"creating the engine {'LeaderWorkerSet' if isvc.spec.multi_pod else 'Deployment'}")
    elif any(r == "ProgressDeadlineExceeded" for r, _ in problems):
        progressing = (False, "ProgressDeadlineExceeded", problem_text)
    elif seen.applied_generation != isvc.generation or rollout_in_flight(seen.deployment, desired):
        updated = (seen.deployment.get("status") or {}).get("updatedReplicas", 0)
        progressing = (True, "RollingOut", f"{updated}/{desired} replicas updated, {ready} ready")
    else:
        progressing = (False, "RolloutComplete", f"{desired} replicas on the current spec")
    # Last: they do not keep replicas from becoming Ready, so they never name the Ready reason.
    problems += autoscaler_problems(isvc, seen.keda_installed) + pool_crd_problems(isvc, seen.pool_crd_missing)
    degraded = (True, problems[0][0], "; ".join(dict.fromkeys(m for _, m in problems))[:MAX_MESSAGE]) \
        if problems else (False, "AsExpected", "no problems observed")
    found = [("Ready", *ready_c), ("Progressing", *progressing), ("Degraded", *degraded)]
    return found + [adapter_condition(isvc, seen.adapters)] if isvc.spec.lora_enabled else found


def observe(isvc: InferenceService, seen: Observed, config: OperatorConfig,
            previous: InferenceServiceStatus, now: datetime) -> InferenceServiceStatus:
    """The status to write; a condition keeps its lastTransitionTime while its status holds."""
    dep_status = (seen.deployment or {}).get("status") or {}
    ready = dep_status.get("readyReplicas", 0)
    before = {c.type: c for c in previous.conditions}
    was_ready = "Ready" in before and before["Ready"].status == "True"
    new_conditions = []
    for type_, ok, reason, message in conditions(isvc, seen, ready, was_ready):
        status = "True" if ok else "False"
        old = before.get(type_)
        since = old.last_transition_time if old and old.status == status else now
        new_conditions.append(Condition(type=type_, status=status, reason=reason, message=message,
                                        observed_generation=seen.applied_generation,
                                        last_transition_time=since))
    return previous.model_copy(update={
        "observed_generation": seen.applied_generation, "conditions": new_conditions,
        "replicas": dep_status.get("replicas", 0), "ready_replicas": ready,
        "updated_replicas": dep_status.get("updatedReplicas", 0),
        "desired_replicas": isvc.spec.replicas, "replica_summary": f"{ready}/{isvc.spec.replicas}",
        "selector": isvc.selector, "url": isvc.url(config),
        "served_model_name": isvc.spec.model.served_name
        or model_mounts(isvc, isvc.spec.engine.image or config.engine_image, config).served_name,
        **adapter_status(isvc, seen.adapters)})
