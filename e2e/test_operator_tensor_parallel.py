"""Issue #8 operator acceptance on the local cluster: tensor-parallel InferenceServices, for real.

The pods use kubeinfer's own image (the chart's default), so the local pod runner starts a real
`kubeinfer serve --tensor-parallel-size N` on the embedded SmolLM2 (9 attention heads, 3 KV
heads): N=3 splits it over three gloo ranks and serves a chat completion; N=2 does not divide the
heads, and the engine's refusal must reach the InferenceService's Degraded condition.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for
from e2e.test_operator import apply, condition, deployment, get_isvc, wait_condition

pytestmark = pytest.mark.e2e
TP_LOAD_TIMEOUT = 600  # three ranks each load a shard on a shared 2-core machine


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> str:
    """The chart installed (or upgraded) as e2e/test_operator.py does, so concurrent runs agree."""
    cluster.install_chart("operator.driftIntervalSeconds=15")
    return SYSTEM_NS


def embedded_tp(name: str, tensor_parallel_size: int) -> dict[str, Any]:
    """The embedded model on the CPU with kubeinfer's own image, small enough for a shared box."""
    return {"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
                     "engine": {"device": "cpu", "tensorParallelSize": tensor_parallel_size,
                                "kvCacheMemory": "64Mi", "maxNumSeqs": 4,
                                "maxNumBatchedTokens": 512},
                     "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1}}


def chat(pod_ip: str) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": "smollm2", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    request = urllib.request.Request(f"http://{pod_ip}:8000/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as response:
        return response.status, json.load(response)


def test_tensor_parallel_3_serves_a_chat_completion(local_cluster: Cluster, operator: str,
                                                    namespace: str) -> None:
    apply(local_cluster, namespace, embedded_tp("tp3", 3))
    pod_spec = wait_for(lambda: (d := deployment(local_cluster, namespace, "tp3")) and
                        d["spec"]["template"]["spec"], "Deployment tp3", timeout=60)
    args = pod_spec["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "3", args
    shm = [v["name"] for v in pod_spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm
               for m in pod_spec["containers"][0]["volumeMounts"]), pod_spec

    obj = wait_condition(local_cluster, namespace, "tp3", "Ready", timeout=TP_LOAD_TIMEOUT)
    pod = next(p for p in local_cluster.pods(namespace, obj["status"]["selector"]) if pod_ready(p))
    status, answer = chat(pod.status.pod_ip)
    assert status == 200
    assert answer["choices"][0]["message"]["content"].strip(), answer
    table = local_cluster.kubectl("get", "kis", "tp3", "-n", namespace, "-o", "wide").stdout.split("\n")
    assert table[1].split()[:6] == ["tp3", "True", "1/1", "embedded", "smollm2", "3"]


def test_tensor_parallel_size_not_dividing_the_heads_is_degraded(local_cluster: Cluster,
                                                                 operator: str,
                                                                 namespace: str) -> None:
    apply(local_cluster, namespace, embedded_tp("tp2", 2))
    engine_message = "tensor_parallel_size 2 does not divide the model's 9 attention heads"

    seen: list[dict[str, Any]] = [{}]

    def degraded_with_engine_message() -> dict[str, Any] | None:
        seen[0] = condition(get_isvc(local_cluster, namespace, "tp2"), "Degraded")
        return seen[0] if seen[0].get("status") == "True" \
            and engine_message in seen[0].get("message", "") else None

    try:
        degraded = wait_for(degraded_with_engine_message, f"Degraded naming {engine_message!r}",
                            timeout=420, interval=2)
    except TimeoutError as timeout:
        raise AssertionError(f"{timeout}; Degraded condition: {seen[0]}") from None
    assert degraded["reason"] == "CrashLoopBackOff", degraded
    assert condition(get_isvc(local_cluster, namespace, "tp2"), "Ready")["status"] == "False"
