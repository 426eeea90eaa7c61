"""The reconcile loop against an in-memory API: idempotent, prunes the PDB, reports failures."""

from __future__ import annotations

from typing import Any

import pytest
from isvc_builders import CONFIG, body, pending_pod

from kubeinfer.server.kube.client import KubeError
from kubeinfer.operator.reconcile import Reconciler

pytestmark = pytest.mark.unit


class MemoryKube:
    """Stores what is applied; `refuse` makes applies of one kind fail like the API would."""

    def __init__(self, refuse: str | None = None) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.listed: dict[str, list[dict[str, Any]]] = {}  # kind -> what list() returns
        self.statuses: list[dict[str, Any]] = []
        self.applies = 0
        self.refuse = refuse

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == self.refuse:
            raise KubeError(422, f'{obj["kind"]}.apps "chat" is invalid: spec.template: bad',
                            "Invalid")
        self.applies += 1
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj

    def create(self, obj: dict[str, Any]) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = obj
        return True

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.listed.get(kind, [])

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, name), None)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    def label(self, kind: str, namespace: str, name: str, labels: dict[str, str | None]) -> None:
        node = next(n for n in self.listed.get(kind, []) if n["metadata"]["name"] == name)
        current = node["metadata"].setdefault("labels", {})
        current.update(labels)
        for key in [k for k, v in labels.items() if v is None]:   # a merge patch's null removes it
            del current[key]

    def delete_with_dependents(self, kind: str, namespace: str, name: str) -> None:
        self.delete(kind, namespace, name)


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: f'{c["status"]}/{c["reason"]}' for c in status["conditions"]}


def test_creates_children_and_writes_status() -> None:
    kube = MemoryKube()
    Reconciler(kube, CONFIG).reconcile(body(), trigger="create")  # type: ignore[arg-type]
    assert set(kube.objects) == {("Deployment", "chat"), ("Service", "chat"), ("Deployment", "chat-gateway"),
                                 ("ServiceAccount", "chat-gateway"), ("Role", "chat-gateway"),
                                 ("RoleBinding", "chat-gateway"),   # the router, one pod: no PDB
                                 ("Secret", "chat-kv-hash-key")}
    status = kube.statuses[-1]
    assert status["observedGeneration"] == 1 and status["replicaSummary"] == "0/1"
    assert conditions(status)["Progressing"] == "True/RollingOut"


def test_the_hash_key_secret_is_created_once_and_read_by_the_pods_only() -> None:
    """Random, created (never applied: the operator cannot read Secrets back), kept on later
    reconciles; the engines get it from the kubelet as an env var."""
    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    reconciler.reconcile(body(), trigger="create")  # type: ignore[arg-type]
    secret = kube.objects[("Secret", "chat-kv-hash-key")]
    value = secret["stringData"]["kv-hash-key"]
    assert len(value) >= 43 and secret["immutable"] and secret["metadata"]["ownerReferences"][0]["name"] == "chat"
    reconciler.reconcile(body(), trigger="drift")  # type: ignore[arg-type]
    assert kube.objects[("Secret", "chat-kv-hash-key")]["stringData"]["kv-hash-key"] == value
    env = kube.objects[("Deployment", "chat")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "KUBEINFER_KV_HASH_KEY", "valueFrom": {"secretKeyRef": {
        "name": "chat-kv-hash-key", "key": "kv-hash-key"}}} in env
    assert value not in str(kube.objects[("Deployment", "chat")])


def test_reconcile_twice_applies_the_same_objects() -> None:
    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    reconciler.reconcile(body({"replicas": 2}), trigger="create")  # type: ignore[arg-type]
    first = {k: dict(v) for k, v in kube.objects.items()}
    reconciler.reconcile(body({"replicas": 2}), trigger="drift")  # type: ignore[arg-type]
    assert kube.objects == first


def test_pdb_removed_when_scaled_to_one() -> None:
    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    reconciler.reconcile(body({"replicas": 3}), trigger="create")  # type: ignore[arg-type]
    assert ("PodDisruptionBudget", "chat") in kube.objects
    reconciler.reconcile(body({"replicas": 1}, generation=2), trigger="update")  # type: ignore[arg-type]
    assert ("PodDisruptionBudget", "chat") not in kube.objects


def test_refused_apply_is_degraded_with_the_api_message() -> None:
    kube = MemoryKube(refuse="Deployment")
    events = Reconciler(kube, CONFIG).reconcile(  # type: ignore[arg-type]
        body(generation=3, status={"observedGeneration": 2}), trigger="update")
    status = kube.statuses[-1]
    assert conditions(status)["Degraded"] == "True/ReconcileError"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "spec.template: bad" in degraded["message"] and status["observedGeneration"] == 2
    assert ("Warning", "ReconcileError") in [(e.type, e.reason) for e in events]


def test_spec_the_schema_let_by_is_invalid_not_a_crash() -> None:
    kube = MemoryKube()
    Reconciler(kube, CONFIG).reconcile(  # type: ignore[arg-type]
        body({"model": {"source": "gs://bucket/llama"}}), trigger="create")
    assert kube.objects == {}
    assert conditions(kube.statuses[-1])["Degraded"] == "True/InvalidSpec"
    assert "spec.model.source" in kube.statuses[-1]["conditions"][0]["message"]


def test_status_write_leaves_the_autoscaler_fields_alone() -> None:
    kube = MemoryKube()
    saved = {"autoscaler": {"samples": [], "averageValue": 3.0}, "lastScaleTime": "2026-01-01T00:00:00Z"}
    Reconciler(kube, CONFIG).reconcile(body(status=saved), trigger="resume")  # type: ignore[arg-type]
    assert "autoscaler" not in kube.statuses[-1] and "lastScaleTime" not in kube.statuses[-1]


def test_a_stale_body_does_not_repeat_events() -> None:
    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    stale = body()  # both calls got the object before either wrote status
    first = reconciler.reconcile(stale, trigger="create")  # type: ignore[arg-type]
    second = reconciler.reconcile(stale, trigger="pod", apply=False)  # type: ignore[arg-type]
    assert [e.reason for e in first] == ["RollingOut"] and second == []


def test_a_pod_template_change_is_announced_even_when_progressing_never_flips() -> None:
    """A rollout that finished before it was observed (simulated pods), or began while another
    was in flight, still gets its RollingOut Event; a scale or a no-op apply does not."""
    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    first = reconciler.reconcile(body(), trigger="create")  # type: ignore[arg-type]
    assert [e.reason for e in first] == ["RollingOut"]   # Progressing stays True: nothing reports status
    edited = reconciler.reconcile(body({"engine": {"maxNumSeqs": 7}}, generation=2), trigger="update")  # type: ignore[arg-type]
    assert [e.reason for e in edited] == ["RollingOut"] and "generation 2" in edited[0].message
    again = reconciler.reconcile(body({"engine": {"maxNumSeqs": 7}}, generation=2), trigger="pod")  # type: ignore[arg-type]
    scaled = reconciler.reconcile(body({"engine": {"maxNumSeqs": 7}, "replicas": 2}, generation=3),  # type: ignore[arg-type]
                                  trigger="update")
    assert again == [] and "RollingOut" not in [e.reason for e in scaled]
    restarted = Reconciler(kube, CONFIG)   # a new operator process takes the live template as its baseline
    assert restarted.reconcile(body({"engine": {"maxNumSeqs": 8}}, generation=4), trigger="resume") \
        [-1].reason == "RollingOut"  # type: ignore[arg-type]


def test_reconciles_are_counted_by_trigger_and_result() -> None:
    from prometheus_client import REGISTRY

    def count(trigger: str, result: str) -> float:
        return REGISTRY.get_sample_value("kubeinfer_operator_reconciles_total",
                                         {"trigger": trigger, "result": result}) or 0.0

    before_ok, before_error = count("metrics-test", "ok"), count("metrics-test", "error")
    Reconciler(MemoryKube(), CONFIG).reconcile(body(), trigger="metrics-test")  # type: ignore[arg-type]

    class Unreachable(MemoryKube):
        def get(self, kind: str, namespace: str, name: str) -> None:
            raise ConnectionError("API server unreachable")

    with pytest.raises(ConnectionError):  # kopf retries it; the metric counts it
        Reconciler(Unreachable(), CONFIG).reconcile(body(), trigger="metrics-test")  # type: ignore[arg-type]
    assert count("metrics-test", "ok") == before_ok + 1
    assert count("metrics-test", "error") == before_error + 1


def test_stuck_pods_with_a_gpu_product_look_up_the_nodes() -> None:
    kube = MemoryKube()
    kube.listed = {"Pod": [pending_pod("0/1 nodes are available")],
                   "Node": [{"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-L4"}}}]}
    Reconciler(kube, CONFIG).reconcile(  # type: ignore[arg-type]
        body({"resources": {"gpuProduct": "NVIDIA-A100"}}), trigger="create")
    degraded = next(c for c in kube.statuses[-1]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "GPUProductUnavailable" and "NVIDIA-L4" in degraded["message"]


def test_keda_autoscaler_class_checks_for_keda_and_recovers_once_installed() -> None:
    kube = MemoryKube()
    isvc = body({"autoscaling": {"enabled": False}})
    isvc["metadata"]["annotations"] = {"kubeinfer.io/autoscaler-class": "keda"}
    events = Reconciler(kube, CONFIG).reconcile(isvc, trigger="create")  # type: ignore[arg-type]
    assert conditions(kube.statuses[-1])["Degraded"] == "True/AutoscalerUnavailable"
    warning = next(e for e in events if e.reason == "AutoscalerUnavailable")
    assert warning.type == "Warning" and "scaledobjects.keda.sh" in warning.message
    kube.objects[("CustomResourceDefinition", "scaledobjects.keda.sh")] = {"kind": "CustomResourceDefinition"}
    events = Reconciler(kube, CONFIG).reconcile(isvc, trigger="update")  # type: ignore[arg-type]
    assert conditions(kube.statuses[-1])["Degraded"] == "False/AsExpected"


def test_no_autoscaler_class_never_asks_for_crds() -> None:
    class NoCrds(MemoryKube):
        def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
            assert kind != "CustomResourceDefinition"
            return super().get(kind, namespace, name)

    kube = NoCrds()
    Reconciler(kube, CONFIG).reconcile(body(), trigger="create")  # type: ignore[arg-type]
    assert conditions(kube.statuses[-1])["Degraded"] == "False/AsExpected"


def test_stuck_cuda_pods_count_the_gpus_nodes_advertise() -> None:
    kube = MemoryKube()
    kube.listed = {"Pod": [pending_pod("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")],
                   "Node": [{"metadata": {"labels": {}}, "status": {"allocatable": {"cpu": "4"}}}]}
    Reconciler(kube, CONFIG).reconcile(body({"engine": {"device": "cuda"}}), trigger="create")  # type: ignore[arg-type]
    assert conditions(kube.statuses[-1])["Degraded"] == "True/GPUUnavailable"


def test_a_deleted_service_is_forgotten_through_its_deleted_event() -> None:
    """The per-uid memory (last status written, last pod template, adapter failures, the lock)
    goes when kopf reports the InferenceService DELETED; another service's stays."""
    import kopf

    from kubeinfer.operator import handlers

    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    other = body(name="other")
    other["metadata"]["uid"] = "uid-2"
    for item in (body(), other):
        reconciler.reconcile(item, trigger="create")  # type: ignore[arg-type]
    reconciler.adapters._reported["uid-1"] = {("pod", "adapter"): "HTTP 400"}
    registry = kopf.OperatorRegistry()
    handlers.register(registry, reconciler, drift_seconds=60)
    forget = next(h for h in registry._watching.get_all_handlers() if h.id == "forget")
    forget.fn(event={"type": "MODIFIED", "object": body()})
    assert "uid-1" in reconciler._written and "uid-1" in reconciler._templates
    forget.fn(event={"type": "DELETED", "object": body()})
    assert set(reconciler._written) == set(reconciler._templates) == {"uid-2"}
    assert "uid-1" not in reconciler.adapters._reported and set(reconciler._locks) == {("team-a", "other")}
