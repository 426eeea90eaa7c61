"""Scale-up time of a multi-GB model from the node cache on the local cluster (issue #39).

One InferenceService serving a checkpoint from a hub-compatible endpoint (e2e/model_stores.py,
a real server process on loopback) through the chart's operator: every engine pod's fetch-model
init container fills, or finds, the node's model cache; all pods are pinned to one node.

1. cold: apply with 1 replica on an empty cache (a fresh repository name): apply to the first
   token from that pod (download, load, first token);
2. warm scale 1 -> 2: `kubectl scale` to the first token from the new pod, polled on its pod IP
   from the moment it has one (a request answered there is a request the Service could route);
3. warm scale from zero: autoscaling with minReplicas 0 and its gateway; once it has scaled to
   zero, one request to the gateway, timed to its first streamed token.

Each phase prints the pod's own breakdown from status.model.lastColdStart (fetch, load).

    python benchmarks/model_cache_scale.py CHECKPOINT_DIR [--rounds 2]

CHECKPOINT_DIR: a Hugging Face directory (benchmarks/random_llama.py writes a 2.5 GB one).
Uses the cluster KUBEINFER_CLUSTER_* select, leaves it running and deletes its namespace.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e.localcluster import cluster as cluster_mod  # noqa: E402  (benchmark infrastructure, not product)
from e2e.localcluster.config import ClusterConfig  # noqa: E402
from e2e.demo import bring_up_cluster, install_chart  # noqa: E402
from e2e.helpers import Cluster, wait_for  # noqa: E402
from e2e.model_stores import HubServer  # noqa: E402
from e2e.localcluster.nodes import node_name  # noqa: E402

NAME = "cache-bench"
ENGINES = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
GATEWAYS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids: the random checkpoint's tokenizer is a stand-in


def manifest(source: str, endpoint: str, replicas: int, from_zero: bool) -> str:
    spec: dict[str, Any] = {
        "model": {"source": source, "endpoint": endpoint, "maxModelLen": 512},
        "engine": {"device": "cpu", "kvCacheMemory": "64Mi", "maxNumSeqs": 2, "maxNumBatchedTokens": 256},
        "resources": {"cpu": "1", "memory": "4Gi"}, "replicas": replicas,
        "nodeSelector": {"kubernetes.io/hostname": node_name(0)}, "routing": {"strategy": "none"}}
    if from_zero:
        spec["routing"] = {"strategy": "round-robin"}
        spec["autoscaling"] = {"enabled": True, "metric": "queueDepth", "target": 2, "minReplicas": 0,
                               "maxReplicas": 1, "intervalSeconds": 5, "windowSeconds": 10,
                               "scaleDownDelaySeconds": 10, "activationTimeoutSeconds": 600}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def pods(kube: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return kube.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]


def first_token(url: str, model: str, deadline: float) -> float:
    """Stream one completion from `url` until it answers; the time its first token arrived."""
    while time.monotonic() < deadline:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=httpx.Timeout(600, connect=1), json={
                    "model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True}) as response:
                if response.status_code == 200:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no token from {url}")


def new_pod_url(kube: Cluster, ns: str, old: set[str], deadline: float) -> tuple[str, str]:
    def fresh() -> tuple[str, str] | None:
        for pod in pods(kube, ns, ENGINES):
            if pod["metadata"]["name"] not in old and (pod.get("status") or {}).get("podIP"):
                return pod["metadata"]["name"], f"http://{pod['status']['podIP']}:8000"
        return None
    return wait_for(fresh, "a new engine pod with an IP", timeout=deadline - time.monotonic(), interval=0.1)


def breakdown(kube: Cluster, ns: str, pod: str) -> str:
    def recorded() -> dict[str, Any] | None:
        last = ((kube.kubectl_json("get", "inferenceservice", NAME, "-n", ns).get("status") or {}).get("model")
                or {}).get("lastColdStart") or {}
        return last if last.get("pod") == pod else None
    try:
        last = wait_for(recorded, f"status.model.lastColdStart of {pod}", timeout=60, interval=1)
    except TimeoutError:
        return "(no lastColdStart recorded)"
    return (f"pod {pod}: fetch-model {last.get('fetchSeconds')} s, engine start to Ready {last['loadSeconds']} s, "
            f"creation to Ready {last['totalSeconds']} s")


def run(kube: Cluster, hub: HubServer, checkpoint: Path, ns: str) -> dict[str, float]:
    repo = f"bench/llama-{uuid.uuid4().hex[:6]}"  # a name no node cache holds yet: the cold run is cold
    t = time.monotonic()
    hub.repos.commit(repo, checkpoint)
    print(f"[{ns}] committed {checkpoint} as {repo} in {time.monotonic() - t:.1f} s", flush=True)
    source, times = f"hf://{repo}@main", {}

    start = time.monotonic()
    kube.kubectl("apply", "-n", ns, "-f", "-", stdin=manifest(source, hub.url, 1, False))
    name, url = new_pod_url(kube, ns, set(), start + 1800)
    times["cold"] = first_token(url, repo, start + 1800) - start
    print(f"cold  (empty cache, apply -> first token): {times['cold']:.1f} s; {breakdown(kube, ns, name)}", flush=True)

    old = {p["metadata"]["name"] for p in pods(kube, ns, ENGINES)}
    start = time.monotonic()
    kube.kubectl("scale", "inferenceservice", NAME, "-n", ns, "--replicas=2")
    name, url = new_pod_url(kube, ns, old, start + 600)
    times["scale_1_to_2"] = first_token(url, repo, start + 600) - start
    print(f"warm scale 1 -> 2 (scale -> first token of the new pod): {times['scale_1_to_2']:.1f} s; "
          f"{breakdown(kube, ns, name)}", flush=True)

    kube.kubectl("apply", "-n", ns, "-f", "-", stdin=manifest(source, hub.url, 1, True))
    gateway = wait_for(lambda: next((p for p in pods(kube, ns, GATEWAYS) if p["status"].get("podIP") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])), None),
        "a Ready gateway pod", timeout=300, interval=1)
    wait_for(lambda: kube.kubectl_json("get", "inferenceservice", NAME, "-n", ns)["spec"]["replicas"] == 0,
             "the idle scale to zero", timeout=900, interval=1)
    wait_for(lambda: not pods(kube, ns, ENGINES), "the engine pods gone", timeout=300, interval=1)
    start = time.monotonic()
    times["from_zero"] = first_token(f"http://{gateway['status']['podIP']}:8080", repo, start + 600) - start
    name = pods(kube, ns, ENGINES)[0]["metadata"]["name"]
    print(f"warm scale from zero (request to the gateway -> first token): {times['from_zero']:.1f} s; "
          f"{breakdown(kube, ns, name)}", flush=True)
    print(f"hub GETs: {json.dumps({k: v for k, v in hub.counts().items() if k.startswith(repo)})}", flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    size = sum(p.stat().st_size for p in args.checkpoint.rglob("*") if p.is_file())
    print(f"checkpoint {args.checkpoint}: {size / 1e9:.2f} GB", flush=True)
    cfg = ClusterConfig()
    bring_up_cluster(cfg)
    kube = Cluster(cfg, cluster_mod.api_client(cfg), cfg.kubeconfig)
    install_chart(kube)
    with tempfile.TemporaryDirectory(dir=cfg.state_dir) as root, HubServer(Path(root)) as hub:
        for round_ in range(args.rounds):
            ns = f"cache-bench-{round_}-{uuid.uuid4().hex[:4]}"
            kube.kubectl("create", "namespace", ns)
            try:
                run(kube, hub, args.checkpoint, ns)
            finally:
                kube.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=300s", check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
