"""Issue #24's operator acceptance on the local cluster: LoRA adapters declared on an
InferenceService are loaded into its running engine, added and removed live, never restarting it.

The adapters are tiny random PEFT adapters of the embedded SmolLM2, written onto a claim the test
provides: a hostPath PersistentVolume bound to a PersistentVolumeClaim. The local pod runner does
not mount volumes, but its pods are host processes, so the engine reads the claim's files at the
path a kubelet would have mounted them on (/adapters/<claim>), which is where the hostPath PV
points. The engine is real (`kubeinfer serve --enable-lora`); requests go to the pod and
through the router.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.helpers import Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
NAME = "lora"
ENGINES = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
ROUTERS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"
BASE = "smollm2"
ADAPTERS = {"sql": (8, ["q_proj", "v_proj"]), "chat": (16, ["o_proj", "down_proj"]),
            "code": (8, ["gate_proj", "up_proj", "k_proj"])}


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> None:
    cluster.install_chart("operator.driftIntervalSeconds=15")


@pytest.fixture(scope="module")
def claim_dir() -> Any:
    """/adapters/<claim> on this host, holding the adapters; removed afterwards."""
    claim = f"loras-{uuid.uuid4().hex[:8]}"
    root = Path("/adapters") / claim
    try:
        root.mkdir(parents=True)
    except PermissionError:
        pytest.skip("the local cluster's pods read a claim at /adapters/<claim> on this host; "
                    "the test cannot write there")
    write_adapters(root)
    yield root
    shutil.rmtree(root)


def write_adapters(root: Path) -> None:
    """Random PEFT adapters of the embedded SmolLM2 (its architecture; random base weights do
    not matter, an adapter holds only its own A and B), lora_B random so each changes answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from kubeinfer.server.model.checkpoints.tokenizer_files import embedded_model_path

    gguf = embedded_model_path()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape) * 0.05)
        model.save_pretrained(str(root / name))


@pytest.fixture
def claim(local_cluster: Cluster, namespace: str, claim_dir: Path) -> Any:
    """A hostPath PV pre-bound to a read-only claim in `namespace`; yields the claim's name."""
    cluster, root, claim = local_cluster, claim_dir, claim_dir.name
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{claim}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(root)},
                   "claimRef": {"namespace": namespace, "name": claim}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv["metadata"]["name"],
                    "resources": {"requests": {"storage": "1Gi"}}}}
    for obj in (pv, pvc):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(obj))
    wait_for(lambda: cluster.kubectl_json("get", "pvc", claim, "-n", namespace)["status"].get("phase") == "Bound",
             f"claim {claim} bound", timeout=60)
    yield claim
    cluster.kubectl("delete", "pv", pv["metadata"]["name"], "--wait=false", check=False)


def manifest(claim: str, adapters: list[str]) -> str:
    spec = {"model": {"source": "embedded", "servedName": BASE, "maxModelLen": 512},
            "adapters": [{"name": name, "source": f"pvc://{claim}/{name}"} for name in adapters],
            "engine": {"device": "cpu", "kvCacheMemory": "128Mi", "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
                       "lora": {"maxLoras": 2}},
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def isvc(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", NAME, "-n", namespace)


def adapters_ready(cluster: Cluster, namespace: str, generation: int, status: str = "True",
                   timeout: float = 120) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = isvc(cluster, namespace)
        cond = next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == "AdaptersReady"), {})
        return obj if cond.get("status") == status and obj["status"].get("observedGeneration") == generation \
            and obj["status"].get("readyReplicas") else None
    return wait_for(check, f"AdaptersReady={status} at generation {generation}", timeout=timeout, interval=1)


def engine_pod(cluster: Cluster, namespace: str) -> Any:
    pods = [p for p in cluster.pods(namespace, ENGINES) if pod_ready(p)]
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
        "temperature": 0})


def listed(url: str) -> dict[str, str | None]:
    return {card["id"]: card.get("parent") for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def test_adapters_load_and_unload_live(local_cluster: Cluster, operator: None, namespace: str, claim: str) -> None:
    cluster = local_cluster
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(claim, ["sql", "chat"]))
    obj = adapters_ready(cluster, namespace, 1, timeout=900)
    assert [(a["name"], a["loadedReplicas"]) for a in obj["status"]["adapters"]] == [("sql", 1), ("chat", 1)]
    pod = engine_pod(cluster, namespace)
    engine = f"http://{pod.status.pod_ip}:8000"
    assert listed(engine) == {BASE: None, "sql": BASE, "chat": BASE}
    template = cluster.kubectl_json("get", "deployment", NAME, "-n", namespace)
    args = template["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args

    # kubectl patch adds a third adapter: loaded into the running pod
    cluster.kubectl("patch", "kis", NAME, "-n", namespace, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/adapters/-", "value": {"name": "code", "source": f"pvc://{claim}/code"}}]))
    obj = adapters_ready(cluster, namespace, 2)
    assert obj["status"]["replicaAdapters"] == [{"pod": pod.metadata.name, "adapters": ["chat", "code", "sql"]}]
    answers = {}
    for model in (BASE, "sql", "chat", "code"):
        response = complete(engine, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        answers[model] = response.json()["choices"][0]["message"]["content"]
    assert len(set(answers.values())) > 1, answers   # the adapters change what the model says
    router = wait_for(lambda: next((p for p in cluster.pods(namespace, ROUTERS) if pod_ready(p)), None),
                      "a ready router pod", timeout=120)
    through_router = complete(f"http://{router.status.pod_ip}:8080", "code")
    assert through_router.status_code == 200 and through_router.json()["model"] == "code", through_router.text

    # issue #37: the Service (its router) and the engine's API port refuse what only the operator
    # and the routers use; the engine's admin port, which no Service exposes, serves them
    service = cluster.kubectl_json("get", "service", NAME, "-n", namespace)
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["http"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    for url in (f"http://{router.status.pod_ip}:8080", engine):
        for method, path in (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                             ("GET", "/kv/blocks")):
            refused = httpx.request(method, url + path, json={"lora_name": "sql", "lora_path": "/etc"}, timeout=30)
            assert refused.status_code in (403, 404), (url, path, refused.text)
    assert listed(engine) == {BASE: None, "sql": BASE, "chat": BASE, "code": BASE}   # nothing was unloaded
    digest = httpx.get(f"http://{pod.status.pod_ip}:8001/kv/blocks", timeout=30).json()
    assert digest["hash"] == "kubeinfer-blake2b64-keyed-v1" and digest["stored"]

    # removing one unloads it: 404 model_not_found, gone from /v1/models
    cluster.kubectl("patch", "kis", NAME, "-n", namespace, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/adapters/1"}]))
    obj = adapters_ready(cluster, namespace, 3)
    assert [a["name"] for a in obj["status"]["adapters"]] == ["sql", "code"]
    assert listed(engine) == {BASE: None, "sql": BASE, "code": BASE}
    gone = complete(engine, "chat")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text

    # an adapter the engine refuses: AdaptersReady False with its error, and a Warning Event
    cluster.kubectl("patch", "kis", NAME, "-n", namespace, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/adapters/-", "value": {"name": "missing", "source": f"pvc://{claim}/nope"}}]))
    obj = adapters_ready(cluster, namespace, 4, status="False")
    cond = next(c for c in obj["status"]["conditions"] if c["type"] == "AdaptersReady")
    assert cond["reason"] == "AdapterLoadFailed" and f"adapter missing in pod {pod.metadata.name}" in cond["message"]
    events = cluster.kubectl_json("get", "events", "-n", namespace, "--field-selector",
                                  "involvedObject.kind=InferenceService")["items"]
    reasons = {(e["type"], e["reason"]) for e in events}
    assert {("Normal", "AdapterLoaded"), ("Normal", "AdapterUnloaded"), ("Warning", "AdapterLoadFailed")} <= reasons
    assert complete(engine, "sql").status_code == 200   # the others keep serving

    # all along: the same pod, never restarted, and the same pod template
    now = engine_pod(cluster, namespace)
    assert now.metadata.uid == pod.metadata.uid
    assert [s.restart_count for s in now.status.container_statuses] == [0]
    after = cluster.kubectl_json("get", "deployment", NAME, "-n", namespace)
    assert after["metadata"]["generation"] == template["metadata"]["generation"]

    # a pod created later gets the current adapters, and only then opens its readiness gate
    cluster.kubectl("patch", "kis", NAME, "-n", namespace, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/adapters/2"}]))
    adapters_ready(cluster, namespace, 5)
    cluster.kubectl("delete", "pod", pod.metadata.name, "-n", namespace, "--wait=false")

    def replaced() -> Any:
        found = [p for p in cluster.pods(namespace, ENGINES)
                 if p.metadata.uid != pod.metadata.uid and not p.metadata.deletion_timestamp]
        gate = [c for p in found for c in p.status.conditions or [] if c.type == "kubeinfer.io/adapters-loaded"]
        return (found[0], gate[0]) if found and gate else None
    new, gate = wait_for(replaced, "a new engine pod with its adapters gate open", timeout=900, interval=2)
    assert (gate.status, gate.reason) == ("True", "AdaptersLoaded")
    assert listed(f"http://{new.status.pod_ip}:8000") == {BASE: None, "sql": BASE, "code": BASE}
