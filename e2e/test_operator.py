"""Issue #6 acceptance on the local cluster: the chart, the CRD and the reconciler, for real.

The operator runs from the Helm chart as a local process (its image is kubeinfer's own). Engine
pods use a foreign image unless a test needs a real engine, so kwok simulates them and the
tests stay fast; the embedded-model test runs a real `kubeinfer serve` and chats with it.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.localcluster.config import ClusterConfig
from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "crds" / "examples"
SIMULATED_IMAGE = "registry.example.com/simulated-engine:1"  # not ours: kwok runs its pods


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> str:
    """The chart installed (or upgraded) once per module, watching the whole cluster."""
    cluster.install_chart("operator.driftIntervalSeconds=15")
    return SYSTEM_NS


def manifest(name: str, spec: dict[str, Any], image: str | None = SIMULATED_IMAGE) -> dict[str, Any]:
    spec = {**spec, "engine": {**({"image": image} if image else {}), **spec.get("engine", {})}}
    return {"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": spec}


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any], check: bool = True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(obj), check=check)


def get_isvc(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", name, "-n", namespace)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind]
    return found[0] if found else {}


def wait_condition(cluster: Cluster, namespace: str, name: str, kind: str, status: str = "True",
                   timeout: float = 120, generation: int | None = None) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = get_isvc(cluster, namespace, name)
        cond = condition(obj, kind)
        caught_up = generation is None or (obj.get("status") or {}).get("observedGeneration") == generation
        return obj if cond.get("status") == status and caught_up else None
    return wait_for(check, f"{namespace}/{name} {kind}={status}", timeout=timeout, interval=1)


def deployment(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    found = cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def test_embedded_example_serves_a_chat_completion(cluster: Cluster, operator: str,
                                                   namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "embedded-model.yaml"))
    obj = wait_condition(cluster, namespace, "smollm2", "Ready", timeout=600)
    assert obj["status"]["url"] == f"http://smollm2.{namespace}.svc.cluster.local"
    pod = next(p for p in cluster.pods(namespace, obj["status"]["selector"]) if pod_ready(p))
    body = json.dumps({"model": obj["status"]["servedModelName"], "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    request = urllib.request.Request(f"http://{pod.status.pod_ip}:8000/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["model"] == "SmolLM2-135M-Instruct"
    table = cluster.kubectl("get", "kis", "-n", namespace, "-o", "wide").stdout.split("\n")
    assert table[0].split() == ["NAME", "READY", "REPLICAS", "MODEL", "SERVED", "TP", "PP", "PODS", "AGE", "URL"]
    assert table[1].split()[:8] == ["smollm2", "True", "1/1", "embedded", "SmolLM2-135M-Instruct", "1", "1", "1"]


def test_autoscaled_example_settles_without_restarts(cluster: Cluster, operator: str,
                                                     namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "autoscaled.yaml"))
    obj = wait_condition(cluster, namespace, "smollm2-autoscaled", "Ready", timeout=600)

    def sampled() -> set[str]:
        status = get_isvc(cluster, namespace, "smollm2-autoscaled").get("status") or {}
        return {sample["time"] for sample in (status.get("autoscaler") or {}).get("samples") or []}
    before = sampled()
    wait_for(lambda: len(sampled() - before) >= 2, "two autoscaler rounds on the idle service", timeout=120,
             interval=1)
    obj = get_isvc(cluster, namespace, "smollm2-autoscaled")
    assert condition(obj, "Ready")["status"] == "True" and condition(obj, "Degraded")["status"] == "False"
    pods = cluster.pods(namespace, obj["status"]["selector"])
    assert [s.restart_count for p in pods for s in p.status.container_statuses] == [0]
    events = cluster.kubectl_json("get", "events", "-n", namespace)["items"]
    assert not [e for e in events if e["type"] == "Warning" or e["reason"] == "Recovered"], events


def test_a_service_without_model_or_device_becomes_ready_on_cpu(cluster: Cluster, operator: str,
                                                                namespace: str) -> None:
    """The defaults alone (embedded model, device auto) serve on a cluster whose GPUs are fake."""
    apply(cluster, namespace, manifest("bare", {}, image=None))
    obj = wait_condition(cluster, namespace, "bare", "Ready", timeout=600)
    args = deployment(cluster, namespace, "bare")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--device") + 1] == "cpu"
    assert obj["status"]["servedModelName"] == "SmolLM2-135M-Instruct"
    pods = cluster.pods(namespace, obj["status"]["selector"])
    assert all(s.restart_count == 0 for p in pods for s in p.status.container_statuses)


def test_spec_edit_rolls_the_deployment(cluster: Cluster, operator: str, namespace: str) -> None:
    apply(cluster, namespace, manifest("roll", {"engine": {"device": "cpu"}}))
    wait_condition(cluster, namespace, "roll", "Ready")
    apply(cluster, namespace, manifest("roll", {"engine": {"device": "cpu", "maxNumSeqs": 7}}))
    obj = wait_condition(cluster, namespace, "roll", "Progressing", "False", generation=2)
    assert condition(obj, "Ready")["status"] == "True"
    assert condition(obj, "Ready")["observedGeneration"] == 2
    args = deployment(cluster, namespace, "roll")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "7"
    # kopf posts Events from a queue of its own, after the handler that made them returned.
    wait_for(lambda: "RollingOut" in cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=InferenceService",
        "-o", "json").stdout, "a RollingOut Event on the InferenceService", timeout=30)


def test_deleted_or_edited_deployment_comes_back(cluster: Cluster, operator: str,
                                                 namespace: str) -> None:
    apply(cluster, namespace, manifest("drift", {"engine": {"device": "cpu"}}))
    wait_condition(cluster, namespace, "drift", "Ready")
    first_uid = deployment(cluster, namespace, "drift")["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "drift", "-n", namespace)
    back = wait_for(lambda: (d := deployment(cluster, namespace, "drift")) and
                    d["metadata"]["uid"] != first_uid and d, "Deployment recreated", timeout=60)
    assert back["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    patch = [{"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": ["serve"]}]
    cluster.kubectl("patch", "deployment", "drift", "-n", namespace, "--type=json",
                    "-p", json.dumps(patch))
    wait_for(lambda: "--device" in deployment(cluster, namespace, "drift")["spec"]["template"]
             ["spec"]["containers"][0]["args"], "args restored", timeout=60)
    cluster.kubectl("label", "deployment", "drift", "-n", namespace, "team=search")
    assert deployment(cluster, namespace, "drift")["metadata"]["labels"]["team"] == "search"


def test_deleting_the_service_removes_every_child(cluster: Cluster, operator: str,
                                                  namespace: str) -> None:
    apply(cluster, namespace, manifest("gone", {"replicas": 2, "engine": {"device": "cpu"}}))
    wait_condition(cluster, namespace, "gone", "Ready")
    selector = "kubeinfer.io/inferenceservice=gone"
    for kind in ("deployment", "service", "poddisruptionbudget"):
        assert cluster.kubectl_json("get", kind, "-n", namespace, "-l", selector)["items"], kind
    cluster.kubectl("delete", "inferenceservice", "gone", "-n", namespace, "--wait=true")
    wait_for(lambda: not any(cluster.kubectl_json("get", kind, "-n", namespace, "-l", selector)["items"]
                             for kind in ("deployment", "service", "poddisruptionbudget", "pods")),
             "children garbage-collected", timeout=120)


@pytest.mark.parametrize("name, spec, message", [
    ("bounds", {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}},
     "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"),
    ("tp-zero", {"engine": {"tensorParallelSize": 0}}, "should be greater than or equal to 1"),
    ("tp-sixteen", {"engine": {"tensorParallelSize": 16}}, "should be less than or equal to 8"),
    ("negative", {"replicas": -1}, "should be greater than or equal to 0"),
    ("scheme", {"model": {"source": "gs://bucket/llama"}}, "model.source must be 'embedded'"),
    ("x" * 51, {}, "metadata.name must be at most 50 characters"),
    ("chat-gateway", {}, "metadata.name must not end in '-gateway'"),
    ("no-routers", {"routing": {"strategy": "prefix-aware", "replicas": 0}},
     "routing.replicas must be at least 1 unless routing.strategy is none"),
    ("strategy", {"routing": {"strategy": "random"}}, "supported values"),
])
def test_invalid_manifests_are_refused(cluster: Cluster, operator: str, namespace: str,
                                       name: str, spec: dict, message: str) -> None:
    result = apply(cluster, namespace, manifest(name, spec), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_tensor_parallel_pods_request_their_gpus(cluster: Cluster, operator: str,
                                                 namespace: str) -> None:
    apply(cluster, namespace, manifest("tp3", {"engine": {"device": "cuda", "tensorParallelSize": 3}}))
    obj = wait_condition(cluster, namespace, "tp3", "Ready")
    pod = cluster.pods(namespace, obj["status"]["selector"])[0]
    assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "3"
    assert pod.spec.node_name.startswith("kubeinfer-gpu-")
    assert any(v.name == "dshm" and v.empty_dir.medium == "Memory" for v in pod.spec.volumes)


def test_unschedulable_gpu_request_is_degraded(cluster: Cluster, operator: str,
                                               namespace: str) -> None:
    apply(cluster, namespace, manifest("nogpu", {"resources": {"gpuProduct": "NVIDIA-B200"}}))
    obj = wait_condition(cluster, namespace, "nogpu", "Degraded", timeout=90)
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "GPUProductUnavailable"
    assert "no node has nvidia.com/gpu.product=NVIDIA-B200" in degraded["message"]
    assert ClusterConfig().gpu_product in degraded["message"]  # what the cluster does have
    assert "node affinity/selector" in degraded["message"], degraded["message"]  # the scheduler
    assert condition(obj, "Ready")["status"] == "False"


def test_cuda_where_the_container_has_none_is_device_unavailable(cluster: Cluster, operator: str,
                                                                namespace: str) -> None:
    """The fake GPU nodes schedule it, the real engine finds no CUDA: exit 78, not a bare crash loop."""
    apply(cluster, namespace, manifest("nocuda", {"engine": {"device": "cuda"}}, image=None))
    seen: list[dict[str, Any]] = [{}]

    def device_unavailable() -> dict[str, Any] | None:
        seen[0] = get_isvc(cluster, namespace, "nocuda")
        degraded = condition(seen[0], "Degraded")
        return seen[0] if degraded.get("reason") == "DeviceUnavailable" else None

    try:
        obj = wait_for(device_unavailable, "Degraded DeviceUnavailable", timeout=420, interval=2)
    except TimeoutError as timeout:
        raise AssertionError(f"{timeout}; status: {seen[0].get('status')}") from None
    degraded = condition(obj, "Degraded")
    assert "device 'cuda' requested but CUDA is not available" in degraded["message"], degraded
    assert "exit code 78" in degraded["message"] and "set spec.engine.device to cpu or auto" in degraded["message"]
    assert condition(obj, "Ready")["status"] == "False"
    events = cluster.kubectl_json("get", "events", "-n", namespace,
                                  "--field-selector", "involvedObject.name=nocuda")["items"]
    assert any(e["reason"] == "DeviceUnavailable" and e["type"] == "Warning" for e in events), events


def test_more_gpus_than_the_cluster_has_is_degraded(cluster: Cluster, operator: str,
                                                 namespace: str) -> None:
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    gpus = sum(int(n["status"]["allocatable"].get("nvidia.com/gpu", 0)) for n in nodes)
    replicas = gpus // 8 + 1  # pods of tensorParallelSize 8: one more than the GPUs can hold
    apply(cluster, namespace, manifest("toomany", {"replicas": replicas,
                                                   "engine": {"device": "cuda", "tensorParallelSize": 8}}))
    obj = wait_condition(cluster, namespace, "toomany", "Degraded", timeout=90)
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in degraded["message"], degraded["message"]


def test_kubectl_scale(cluster: Cluster, operator: str, namespace: str) -> None:
    apply(cluster, namespace, manifest("scaled", {"engine": {"device": "cpu"}}))
    wait_condition(cluster, namespace, "scaled", "Ready")
    cluster.kubectl("scale", "inferenceservice/scaled", "--replicas=3", "-n", namespace)
    wait_for(lambda: get_isvc(cluster, namespace, "scaled")["status"].get("readyReplicas") == 3,
             "3 ready replicas", timeout=90)
    assert deployment(cluster, namespace, "scaled")["spec"]["replicas"] == 3
    assert cluster.kubectl_json("get", "pdb", "scaled", "-n", namespace)["spec"]["maxUnavailable"] == 1


def test_operator_restart_converges_without_duplicates(cluster: Cluster, operator: str,
                                                       namespace: str) -> None:
    apply(cluster, namespace, manifest("restart", {"replicas": 2, "engine": {"device": "cpu"}}))
    cluster.kubectl("delete", "pod", "-n", operator, "-l", "app.kubernetes.io/component=operator",
                    "--wait=false")
    obj = wait_condition(cluster, namespace, "restart", "Ready", timeout=180, generation=1)
    wait_for(lambda: len(cluster.pods(namespace, obj["status"]["selector"])) == 2, "2 pods", 60)
    replica_sets = cluster.kubectl_json("get", "rs", "-n", namespace, "-l", obj["status"]["selector"])
    assert len(replica_sets["items"]) == 1
