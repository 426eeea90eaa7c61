"""Small builders for InferenceService objects and observed children in operator tests."""

from __future__ import annotations

from typing import Any

from kubeinfer.operator.resource import InferenceService, OperatorConfig
from kubeinfer.operator.spec import InferenceServiceSpec

CONFIG = OperatorConfig(engine_image="kubeinfer/kubeinfer:test")


def make_isvc(spec: dict[str, Any] | None = None, name: str = "chat", generation: int = 1) -> InferenceService:
    return InferenceService(name=name, namespace="team-a", uid="uid-1", generation=generation,
                            spec=InferenceServiceSpec.model_validate(spec or {}))


def body(spec: dict[str, Any] | None = None, name: str = "chat", generation: int = 1,
         status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1",
                         "generation": generation},
            "spec": spec or {}, "status": status or {}}


def deployment_with(replicas: int, ready: int, updated: int | None = None,
                    generation: int = 1, observed: int = 1,
                    conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    updated = replicas if updated is None else updated
    return {"metadata": {"name": "chat", "generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas,
                       "readyReplicas": ready, "availableReplicas": ready,
                       "updatedReplicas": updated, "conditions": conditions or []}}


def pending_pod(message: str) -> dict[str, Any]:
    return {"metadata": {"name": "chat-abc"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": message}]}}


def crashing_pod() -> dict[str, Any]:
    return {"metadata": {"name": "chat-xyz"}, "status": {"phase": "Running", "containerStatuses": [
        {"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                 "message": "back-off 40s restarting"}},
         "lastState": {"terminated": {"exitCode": 1, "message": "heads not divisible by tp"}}}]}}


def ready_pod(name: str = "chat-gateway-abc") -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}}


def by_key(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Rendered children by (kind, name)."""
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a label selector's equality terms select these labels."""
    return selector.items() <= labels.items()
