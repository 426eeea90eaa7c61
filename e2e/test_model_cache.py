"""Issue #39 on the local cluster: InferenceServices from a hub-compatible endpoint and an
S3-compatible store, each file fetched once per node into the node's model cache.

The stores are real server processes on loopback (e2e/model_stores.py) holding a tiny random
Llama; the chart's operator resolves the hub revision, the engine pods' fetch-model init
containers (`kubeinfer fetch`) fill the node's hostPath cache (e2e/localcluster/podvolumes.py maps it to
``<state>/nodes/<node>/...``) and the engines serve from it. Every pod is pinned to one node,
so a second download would be a second GET at the store.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from e2e.helpers import Cluster, wait_for
from e2e.model_stores import HubServer, S3Server
from e2e.localcluster.nodes import node_name

pytestmark = pytest.mark.e2e
NAME = "cached"
ENGINES = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
NODE = node_name(0)
CACHE = "var/lib/kubeinfer/models/models"  # the chart's modelCache.path, then `fetch --cache-dir .../models`


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> None:
    cluster.install_chart("operator.driftIntervalSeconds=15")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two versions of a tiny random Llama (safetensors + tokenizer): a branch head moves between them."""
    from tests.helpers.tiny_models import build_tiny_llama

    root = tmp_path_factory.mktemp("weights")
    return {"v1": build_tiny_llama(root, seed=0, name="v1")[0], "v2": build_tiny_llama(root, seed=1, name="v2")[0]}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


def manifest(model: dict[str, Any], replicas: int) -> str:
    spec = {"model": {**model, "maxModelLen": 256},
            "engine": {"device": "cpu", "kvCacheMemory": "16Mi", "maxNumSeqs": 2, "maxNumBatchedTokens": 256},
            "resources": {"cpu": "1", "memory": "1Gi"}, "replicas": replicas,
            "nodeSelector": {"kubernetes.io/hostname": NODE}, "routing": {"strategy": "none"}}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def isvc(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", NAME, "-n", namespace)


def engine_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "pods", "-n", namespace, "-l", ENGINES)["items"]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def ready_engines(cluster: Cluster, namespace: str, count: int) -> list[dict[str, Any]]:
    """Wait for `count` Ready engine pods (the engine loads the tiny model on the CPU)."""
    return wait_for(lambda: len(pods := [p for p in engine_pods(cluster, namespace) if ready(p)]) == count
                    and pods, f"{count} Ready engine pods", timeout=600, interval=2)


def answers(pod: dict[str, Any], model: str) -> None:
    response = httpx.post(f"http://{pod['status']['podIP']}:8000/v1/completions", timeout=60,
                          json={"model": model, "prompt": "hello", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def fetched_source(pod: dict[str, Any]) -> str:
    fetch = next(c for c in pod["spec"]["initContainers"] if c["name"] == "fetch-model")
    return fetch["args"][fetch["args"].index("--model") + 1]


def file_names(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_hub_model_pinned_per_generation_is_fetched_once_per_node(
        cluster: Cluster, operator: None, namespace: str, hub: HubServer, weights: dict[str, Path]) -> None:
    repo = f"org/tiny-{uuid.uuid4().hex[:6]}"
    first = hub.repos.commit(repo, weights["v1"])
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    stdin=manifest({"source": f"hf://{repo}@main", "endpoint": hub.url}, replicas=1))
    answers(ready_engines(cluster, namespace, 1)[0], repo)
    status = isvc(cluster, namespace)["status"]
    assert status["model"]["revision"] == first
    hub.repos.commit(repo, weights["v2"])  # the branch head moves on
    cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas=3")
    pods = ready_engines(cluster, namespace, 3)
    assert {fetched_source(p) for p in pods} == {f"hf://{repo}@{first}"}  # the running generation's commit
    for pod in pods:
        answers(pod, repo)
    assert isvc(cluster, namespace)["status"]["model"]["revision"] == first
    for name in file_names(weights["v1"]):
        assert hub.gets(f"{repo}/{name}") == 1, (name, hub.counts())
    assert isvc(cluster, namespace)["status"]["model"]["lastColdStart"]["pod"] in {p["metadata"]["name"] for p in pods}


def test_s3_model_on_three_replicas_at_once_downloads_each_object_once(
        cluster: Cluster, operator: None, namespace: str, s3: S3Server, weights: dict[str, Path]) -> None:
    prefix = f"tiny-{uuid.uuid4().hex[:6]}"
    keys = s3.upload_folder("weights", prefix, weights["v1"])
    env = s3.env()
    cluster.core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-creds"}, "stringData": {
        k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(
        {"source": f"s3://weights/{prefix}", "endpoint": s3.url, "credentialsSecret": "s3-creds"}, replicas=3))
    pods = ready_engines(cluster, namespace, 3)
    for pod in pods:
        answers(pod, prefix)
    for key in keys:
        assert s3.gets(f"weights/{key}") == 1, (key, s3.counts())
    # each fetch's report (its termination message): one pod downloaded every byte, the others none
    reports = [json.loads(next(c for c in p["status"]["initContainerStatuses"] if c["name"] == "fetch-model")
                          ["state"]["terminated"]["message"]) for p in pods]
    assert sorted(r["bytes_downloaded"] for r in reports) == [0, 0, sum(f.stat().st_size for f in
                                                                        weights["v1"].rglob("*") if f.is_file())]
    digest = reports[0]["revision"]
    assert {r["revision"] for r in reports} == {digest}
    model = wait_for(lambda: (m := isvc(cluster, namespace)["status"].get("model") or {}).get("revision") and m,
                     "the listing digest in status.model", timeout=60)
    assert model["revision"] == digest and model["lastColdStart"]["bytesDownloaded"] is not None


def test_a_pod_killed_mid_download_leaves_nothing_a_later_pod_serves(
        cluster: Cluster, operator: None, namespace: str, hub: HubServer, weights: dict[str, Path]) -> None:
    repo = f"org/tiny-{uuid.uuid4().hex[:6]}"
    commit = hub.repos.commit(repo, weights["v1"])
    hub.fault(f"{repo}/model.safetensors", "stall")
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    stdin=manifest({"source": f"hf://{repo}@{commit}", "endpoint": hub.url}, replicas=1))
    repo_dir = cluster.config.state_dir / "nodes" / NODE / CACHE / f"models--{repo.replace('/', '--')}"
    wait_for(lambda: hub.gets(f"{repo}/model.safetensors") >= 1, "the download to begin", timeout=300, interval=1)
    first = engine_pods(cluster, namespace)[0]["metadata"]["name"]
    cluster.kubectl("delete", "pod", first, "-n", namespace, "--wait=false")
    hub.fault(f"{repo}/model.safetensors", None)
    pod = ready_engines(cluster, namespace, 1)[0]
    assert pod["metadata"]["name"] != first
    answers(pod, repo)
    served = repo_dir / "snapshots" / commit
    assert file_names(served) == file_names(weights["v1"])
    for name in file_names(weights["v1"]):
        assert hashlib.sha256((served / name).read_bytes()).digest() == \
            hashlib.sha256((weights["v1"] / name).read_bytes()).digest(), name


def degraded(cluster: Cluster, namespace: str) -> dict[str, Any] | None:
    conditions = (isvc(cluster, namespace).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"), None)


def test_bad_sources_are_named_in_conditions_and_events(
        cluster: Cluster, operator: None, namespace: str, hub: HubServer, s3: S3Server) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-",
                    stdin=manifest({"source": "hf://org/no-such-model@main", "endpoint": hub.url}, replicas=1))
    condition = wait_for(lambda: degraded(cluster, namespace), "Degraded", timeout=120)
    assert condition["reason"] == "ModelNotFound" and "org/no-such-model" in condition["message"]
    assert not engine_pods(cluster, namespace)  # no pod is started for what cannot be served
    s3.client().make_bucket("empty")
    env = s3.env()
    cluster.core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-creds"}, "stringData": {
        k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(
        {"source": "s3://empty/llama", "endpoint": s3.url, "credentialsSecret": "s3-creds"}, replicas=1))
    condition = wait_for(lambda: (c := degraded(cluster, namespace)) and "fetch-model" in c["message"] and c,
                         "Degraded from the fetch", timeout=300, interval=2)
    assert condition["reason"] == "ModelNotFound" and "s3://empty/llama" in condition["message"], condition
    events = cluster.kubectl_json("get", "events", "-n", namespace, "--field-selector",
                                  f"involvedObject.name={NAME}")["items"]
    assert "ModelNotFound" in {e["reason"] for e in events}


def test_warm_ahead_fills_and_labels_nodes_before_any_replica(
        cluster: Cluster, operator: None, namespace: str, hub: HubServer, weights: dict[str, Path]) -> None:
    repo = f"org/tiny-{uuid.uuid4().hex[:6]}"
    commit = hub.repos.commit(repo, weights["v1"])
    spec = json.loads(manifest({"source": f"hf://{repo}@{commit}", "endpoint": hub.url,
                                "cache": {"nodes": 2}}, replicas=0))
    del spec["spec"]["nodeSelector"]  # both nodes are eligible
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(spec))
    nodes = [node_name(i) for i in range(2)]
    model = wait_for(lambda: (m := (isvc(cluster, namespace).get("status") or {}).get("model") or {})
                     .get("cachedNodes") == nodes and m, "both nodes warm", timeout=300, interval=2)
    for node in nodes:
        assert (cluster.config.state_dir / "nodes" / node / CACHE / f"models--{repo.replace('/', '--')}"
                / "snapshots" / commit / "model.safetensors").is_file()
        labels = cluster.kubectl_json("get", "node", node)["metadata"]["labels"]
        assert any(k.startswith("models.kubeinfer.io/") for k in labels)
    assert model["revision"] == commit and not engine_pods(cluster, namespace)
    assert hub.gets(f"{repo}/model.safetensors") == 2  # once per node
