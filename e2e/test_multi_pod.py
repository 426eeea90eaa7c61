"""Issue #40 on the local cluster: an InferenceService whose replicas span 2 pods, run by the real
LeaderWorkerSet controller (e2e/lws.py, started only for this module).

Each group is a leader pod (`kubeinfer serve`, pipeline stage 0, the API) and a worker pod
(`--headless`, stage 1) of the embedded SmolLM2, joined through LWS's environment. The group is
one replica to the operator, the router and `kubectl scale`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from e2e import lws as lws_mod
from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
NAME = "group"
LEADERS = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
WORKERS = f"app.kubernetes.io/component=engine-worker,kubeinfer.io/inferenceservice={NAME}"
ROUTERS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"
LOAD_TIMEOUT = 900   # two pods per group load their stages on a shared 2-core machine


@pytest.fixture(scope="module")
def lws(cluster: Cluster) -> None:
    if not cluster.local:
        pytest.skip("starts LWS on the local cluster (an external one brings its own)")
    lws_mod.start(cluster.config, cluster.kubectl)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, lws: None) -> str:
    cluster.install_chart("operator.driftIntervalSeconds=15")
    return SYSTEM_NS


def manifest(replicas: int) -> str:
    spec = {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
            "engine": {"device": "cpu", "pipelineParallelSize": 2, "podsPerReplica": 2, "kvCacheMemory": "64Mi",
                       "maxNumSeqs": 4, "maxNumBatchedTokens": 256},
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": replicas}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def isvc(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", NAME, "-n", namespace)


def ready_groups(cluster: Cluster, namespace: str, groups: int) -> dict[str, Any] | None:
    status = isvc(cluster, namespace).get("status") or {}
    return status if status.get("replicaSummary") == f"{groups}/{groups}" else None


def router_url(cluster: Cluster, namespace: str) -> str:
    pod = wait_for(lambda: next((p for p in cluster.pods(namespace, ROUTERS) if pod_ready(p)), None),
                   "a Ready router pod", timeout=180, interval=2)
    return f"http://{pod.status.pod_ip}:8080"


def chat(url: str) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_two_pod_replicas_serve_scale_by_groups_and_come_back_from_zero(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    cluster = local_cluster
    explained = cluster.kubectl("explain", "inferenceservice.spec.engine.podsPerReplica").stdout
    assert "LeaderWorkerSet" in explained, explained
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(1))
    wait_for(lambda: ready_groups(cluster, namespace, 1), "1/1 groups Ready", timeout=LOAD_TIMEOUT, interval=3)
    lws = cluster.kubectl_json("get", "leaderworkerset", NAME, "-n", namespace)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert len(cluster.pods(namespace, LEADERS)) == 1 and len(cluster.pods(namespace, WORKERS)) == 1
    service = cluster.kubectl_json("get", "service", NAME, "-n", namespace)
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"   # the router
    url = router_url(cluster, namespace)
    answer = chat(url)
    assert "Paris" in answer, answer

    cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas", "2")
    wait_for(lambda: ready_groups(cluster, namespace, 2), "2/2 groups Ready", timeout=LOAD_TIMEOUT, interval=3)
    assert len(cluster.pods(namespace, LEADERS)) == 2 and len(cluster.pods(namespace, WORKERS)) == 2
    assert cluster.kubectl_json("get", "leaderworkerset", NAME, "-n", namespace)["spec"]["replicas"] == 2
    assert "Paris" in chat(url)

    cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas", "0")
    wait_for(lambda: not cluster.pods(namespace, LEADERS) and not cluster.pods(namespace, WORKERS),
             "every pod of both groups gone", timeout=300, interval=2)
    cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas", "1")
    wait_for(lambda: ready_groups(cluster, namespace, 1), "1/1 groups Ready again", timeout=LOAD_TIMEOUT,
             interval=3)
    assert "Paris" in chat(url)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_deleted_worker_downs_its_leader_at_once_and_the_group_comes_back(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    """Chaos: the worker of group 0 deleted; its leader's /health fails within 2 s (the engine exits
    as its liveness connection drops), requests sent meanwhile are served by group 1 through the
    router (none lost), and LWS recreates group 0, which serves again."""
    from concurrent.futures import ThreadPoolExecutor
    import time

    cluster = local_cluster
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(2))
    wait_for(lambda: ready_groups(cluster, namespace, 2), "2/2 groups Ready", timeout=LOAD_TIMEOUT, interval=3)
    url = router_url(cluster, namespace)
    leader = next(p for p in cluster.pods(namespace, LEADERS) if p.metadata.name == f"{NAME}-0")
    leader_url, old_uid = f"http://{leader.status.pod_ip}:8000", leader.metadata.uid
    assert _healthy(leader_url)

    cluster.kubectl("delete", "pod", f"{NAME}-0-1", "-n", namespace, "--wait=false")
    deleted = time.monotonic()
    with ThreadPoolExecutor(4) as pool:   # sent while group 0 is going down: group 1 serves them
        answers = [pool.submit(chat, url) for _ in range(4)]
        while _healthy(leader_url):
            assert time.monotonic() - deleted < 2, "group 0's leader still healthy 2 s after its worker was deleted"
            time.sleep(0.05)
        assert all("Paris" in answer.result() for answer in answers)

    def recreated() -> bool:
        leaders = {p.metadata.name: p for p in cluster.pods(namespace, LEADERS)}
        return f"{NAME}-0" in leaders and leaders[f"{NAME}-0"].metadata.uid != old_uid \
            and ready_groups(cluster, namespace, 2) is not None
    wait_for(recreated, "group 0 recreated (a new leader) and both groups Ready", timeout=LOAD_TIMEOUT, interval=2)
    new_leader = next(p for p in cluster.pods(namespace, LEADERS) if p.metadata.name == f"{NAME}-0")
    assert pod_ready(new_leader) and _healthy(f"http://{new_leader.status.pod_ip}:8000")
    assert "Paris" in chat(url)
