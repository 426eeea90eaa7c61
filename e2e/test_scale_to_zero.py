"""Scale to zero with the gateway the operator creates itself (issue #7), from the Helm chart.

The chart's operator runs as a local process; at `autoscaling.minReplicas: 0` it creates the
InferenceService's gateway (ServiceAccount, Role, RoleBinding, Deployment) and points the
Service at it. The local cluster has no kube-proxy, so the test talks to the gateway pod's IP,
which is what the Service's endpoints would be.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
NAME = "idle"
ENGINES = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
GATEWAYS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> str:
    """The chart as test_operator.py installs it (same values, so either may run first)."""
    cluster.install_chart("operator.driftIntervalSeconds=15")
    return SYSTEM_NS


def manifest(min_replicas: int, strategy: str = "prefix-aware") -> str:
    """A real engine (the chart's image) that goes idle fast: seconds, not minutes; the gateway
    is also its (prefix-aware by default) router."""
    spec = {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
            "engine": {"device": "cpu", "kvCacheMemory": "64Mi", "maxNumSeqs": 2,
                       "maxNumBatchedTokens": 256},
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1,
            "autoscaling": {"enabled": True, "metric": "queueDepth", "target": 2,
                            "minReplicas": min_replicas, "maxReplicas": 1,
                            "intervalSeconds": 5, "windowSeconds": 10,
                            "scaleDownDelaySeconds": 10, "activationTimeoutSeconds": 600},
            "routing": {"strategy": strategy}}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def isvc(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", NAME, "-n", namespace)


def gateway_objects(cluster: Cluster, namespace: str) -> set[str]:
    """Which of the gateway's four objects exist."""
    return {kind for kind in ("serviceaccount", "role", "rolebinding", "deployment")
            if cluster.kubectl("get", kind, f"{NAME}-gateway", "-n", namespace,
                               check=False).returncode == 0}


def gateway_url(cluster: Cluster, namespace: str) -> str:
    pod = wait_for(lambda: next((p for p in cluster.pods(namespace, GATEWAYS) if pod_ready(p)),
                                None), "a Ready gateway pod", timeout=180, interval=2)
    return f"http://{pod.status.pod_ip}:8080"


def test_operator_gateway_holds_a_request_at_zero_and_wakes_an_engine(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(0))
    wait_for(lambda: len(gateway_objects(local_cluster, namespace)) == 4,
             "the gateway's ServiceAccount, Role, RoleBinding and Deployment", timeout=60)
    service = local_cluster.kubectl_json("get", "service", NAME, "-n", namespace)
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    url = gateway_url(local_cluster, namespace)

    wait_for(lambda: isvc(local_cluster, namespace)["spec"]["replicas"] == 0,
             "the idle scale to zero", timeout=900, interval=2)
    wait_for(lambda: not local_cluster.pods(namespace, ENGINES), "the engine pods gone",
             timeout=120, interval=2)
    at_zero = isvc(local_cluster, namespace)["status"]
    assert at_zero["url"] == f"http://{NAME}.{namespace}.svc.cluster.local"
    ready = next(c for c in at_zero["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")
    assert local_cluster.pods(namespace, GATEWAYS), "the gateway stays up at zero"

    response = httpx.post(f"{url}/v1/chat/completions", timeout=900, json={
        "model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert isvc(local_cluster, namespace)["spec"]["replicas"] == 1
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "kubeinfer_gateway_activations_total 1.0" in metrics  # this request woke it
    assert 'kubeinfer_gateway_requests_total{code="200"} 1.0' in metrics
    events = local_cluster.kubectl_json("get", "events", "-n", namespace, "--field-selector",
                                        f"involvedObject.name={NAME}")["items"]
    assert "NotReady" not in [e["reason"] for e in events]  # the gateway answered throughout

    # without a router, a service that cannot scale to zero needs no gateway
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(1, "none"))
    wait_for(lambda: not gateway_objects(local_cluster, namespace), "the gateway deleted",
             timeout=60)
    service = local_cluster.kubectl_json("get", "service", NAME, "-n", namespace)
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
