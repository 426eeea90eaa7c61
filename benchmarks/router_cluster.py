"""Routing strategies through an InferenceService's Service on the local cluster (issue #19).

One InferenceService with 3 engine replicas and 2 router replicas on the local cluster (e2e/:
the real control plane, kwok nodes, pods as local processes), its Service reached through the
local service proxy, which spreads connections over the router pods as kube-proxy would. For
each round, each strategy in turn: `spec.routing.strategy` patched, the router pods rolled (the
engine pods stay the same throughout: checked), then `kubeinfer bench serve` against the
Service's URL with the shared-prefix workload (the issue's: 8 tenants x 16 requests with
1,024-token prefixes, concurrency 16) and with random prompts. The strategy order rotates
backwards each round, so a round starts with the strategy the last one ended with. Every run
has its own seed, so it starts with prefixes no engine has cached.

    python benchmarks/router_cluster.py OUT_DIR --rounds 3 --kv-cache-memory 128Mi

Leaves the cluster running (`python -m e2e.localcluster down` stops it) and deletes its namespace.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e.localcluster import cluster as cluster_mod, svcproxy  # noqa: E402  (benchmark infrastructure, not product)
from e2e.localcluster.config import ClusterConfig  # noqa: E402
from e2e.demo import build_binaries, bring_up_cluster, install_chart, service_state  # noqa: E402
from e2e.helpers import Cluster, pod_ready, wait_for  # noqa: E402

NAME = "routed-bench"
ENGINES = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
ROUTERS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"
STRATEGIES = ["prefix-aware", "round-robin", "least-load"]


def manifest(args: argparse.Namespace, strategy: str) -> str:
    spec = {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 2048},
            "engine": {"device": "cpu", "kvCacheMemory": args.kv_cache_memory, "maxNumSeqs": 16,
                       "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},   # 3 engines on the cores
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 3,
            "routing": {"strategy": strategy, "replicas": 2}}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def ready_pods(kube: Cluster, ns: str, selector: str) -> list[Any]:
    return [p for p in kube.pods(ns, selector) if pod_ready(p) and not p.metadata.deletion_timestamp]


def engine_urls(kube: Cluster, ns: str) -> dict[str, str]:
    return {p.metadata.name: f"http://{p.status.pod_ip}:8000" for p in ready_pods(kube, ns, ENGINES)}


def metric_sum(text: str, name: str, label: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line.split(" ", 1)[0])


def cache_counts(engines: dict[str, str]) -> tuple[float, float]:
    """Prompt tokens the engines found cached, and looked up, so far."""
    texts = [httpx.get(f"{url}/metrics", timeout=30).text for url in engines.values()]
    return (sum(metric_sum(t, "vllm:prefix_cache_hits_total") for t in texts),
            sum(metric_sum(t, "vllm:prefix_cache_queries_total") for t in texts))


def router_strategy(pod: Any) -> str:
    """The router pod's --strategy (the operator leaves the default, prefix-aware, out)."""
    args = pod.spec.containers[0].args or []
    return args[args.index("--strategy") + 1] if "--strategy" in args else "prefix-aware"


def switch(kube: Cluster, ns: str, strategy: str, engines: dict[str, str]) -> list[str]:
    """Patch the strategy, wait for exactly the new router pods behind the Service, each of them
    routing by key where the strategy uses keys; the router pods' URLs."""
    patch = json.dumps({"spec": {"routing": {"strategy": strategy}}})
    kube.kubectl("patch", "inferenceservice", NAME, "-n", ns, "--type", "merge", "-p", patch)

    def rolled() -> list[Any] | None:
        pods = kube.pods(ns, ROUTERS)
        fresh = [p for p in pods if router_strategy(p) == strategy]
        return fresh if len(pods) == len(fresh) == 2 and all(pod_ready(p) for p in fresh) else None

    pods = wait_for(rolled, f"2 Ready {strategy} router pods", timeout=600, interval=2)
    ips = sorted(p.status.pod_ip for p in pods)

    def proxied() -> bool:
        rows = [r for r in svcproxy.read_table(kube.config.service_table) if (r["namespace"], r["name"]) == (ns, NAME)]
        return bool(rows) and sorted(e.rsplit(":", 1)[0] for e in rows[0]["endpoints"]) == ips

    wait_for(proxied, "the Service's endpoints are the new router pods", timeout=120, interval=1)
    if engine_urls(kube, ns) != engines:
        raise RuntimeError(f"the engine pods changed: {engines} -> {engine_urls(kube, ns)}")
    routers = [f"http://{ip}:8080" for ip in ips]
    if strategy == "prefix-aware":
        for router in routers:
            def keyed() -> bool:
                httpx.post(f"{router}/v1/completions", json={"prompt": [1, 2, 3, int(time.time()) % 1000 + 4],
                                                             "max_tokens": 1}, timeout=300)
                text = httpx.get(f"{router}/metrics", timeout=30).text
                return any(metric_sum(text, "kubeinfer:router_decisions_total", f'reason="{r}"') > 0
                           for r in ("prefix", "affinity", "overload"))
            wait_for(keyed, f"{router} routing by key", timeout=120, interval=2)
    return routers


def bench(out: Path, url: str, dataset: str, label: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = args.num_prompts if dataset == "shared-prefix" else args.random_prompts
    path = out / f"{label.replace('/', '-')}.json"
    subprocess.run(["kubeinfer", "bench", "serve", "--base-url", url, "--dataset", dataset,
                    "--num-groups", "8", "--prefix-len", str(args.prefix_len), "--input-len", "64",
                    "--output-len", "16", "--num-prompts", str(prompts), "--concurrency", str(args.concurrency),
                    "--warmup", "0", "--seed", str(seed), "--no-progress", "--label", label, "--json", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())["levels"][0]


def overhead(routers: list[str]) -> str:
    """The routers' `kubeinfer:router_overhead_seconds` histogram, summed: requests at most 0.5,
    1 and 2 ms, of all."""
    texts = [httpx.get(f"{r}/metrics", timeout=30).text for r in routers]
    at = {le: sum(metric_sum(t, "kubeinfer:router_overhead_seconds_bucket", f'le="{le}"') for t in texts)
          for le in ("0.0005", "0.001", "0.002", "+Inf")}
    return f"{at['0.0005']:g} <= 0.5 ms, {at['0.001']:g} <= 1 ms, {at['0.002']:g} <= 2 ms of {at['+Inf']:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="128Mi",
                        help="each engine's KV cache (128Mi: room for its third of the 8 prefixes, not all)")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=128, help="shared-prefix requests (8 tenants)")
    parser.add_argument("--random-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--namespace", default="bench-routing")
    args = parser.parse_args(argv)
    out, ns, cfg = args.out, args.namespace, ClusterConfig()
    out.mkdir(parents=True, exist_ok=True)
    console = (out / "console.txt").open("a")

    def say(line: str) -> None:
        print(line, flush=True)
        console.write(line + "\n")
        console.flush()

    build_binaries()
    bring_up_cluster(cfg)
    kube = Cluster(cfg, cluster_mod.api_client(cfg), cfg.kubeconfig)
    install_chart(kube)
    kube.kubectl("create", "namespace", ns, check=False)
    kube.kubectl("apply", "-n", ns, "-f", "-", stdin=manifest(args, STRATEGIES[0]))
    wait_for(lambda: service_state(kube, ns, NAME)[0] or None, f"{ns}/{NAME} Ready", timeout=900, interval=2)
    engines = wait_for(lambda: urls if len(urls := engine_urls(kube, ns)) == 3 else None, "3 engines", timeout=600)
    url = svcproxy.local_url(kube.config.service_table, ns, NAME)
    say(f"engines {engines}; Service {ns}/{NAME} at {url}; --kv-cache-memory {args.kv_cache_memory}")
    for name, engine in engines.items():   # the first large batch after start is slower
        subprocess.run(["kubeinfer", "bench", "serve", "--base-url", engine, "--dataset", "random", "--input-len", "64",
                        "--output-len", "16", "--num-prompts", "32", "--concurrency", "32", "--warmup", "0",
                        "--no-progress"], check=True, stdout=subprocess.DEVNULL)
        blocks = metric_sum(httpx.get(f"{engine}/metrics").text, "kubeinfer:kv_cache_blocks_total")
        say(f"engine {name}: {blocks:g} KV blocks")
    rows, seed, current = [], 100, None
    for round_ in range(1, args.rounds + 1):
        order = STRATEGIES[-(round_ - 1) % 3:] + STRATEGIES[:-(round_ - 1) % 3]   # rotated back a step a round
        for strategy in order:
            if strategy != current:
                routers, current = switch(kube, ns, strategy, engines), strategy
            for dataset in ("shared-prefix", "random"):
                seed += 1
                label = f"{strategy}/{dataset}/r{round_}"
                hits0, queries0 = cache_counts(engines)
                load = Path("/proc/loadavg").read_text().split()[0]
                result = bench(out, url, dataset, label, seed, args)
                hits1, queries1 = cache_counts(engines)
                row = {"round": round_, "strategy": strategy, "dataset": dataset, "load": load,
                       "req_s": result["request_throughput"], "ttft_p50": result["ttft_ms"]["p50"],
                       "ttft_p99": result["ttft_ms"]["p99"], "e2e_p50": result["e2e_ms"]["p50"],
                       "errors": result["errors"], "cached": hits1 - hits0, "looked_up": queries1 - queries0}
                rows.append(row)
                say(f"{label}: load {load}, {row['req_s']:.2f} req/s, TTFT p50/p99 {row['ttft_p50']:.0f}/"
                    f"{row['ttft_p99']:.0f} ms, E2E p50 {row['e2e_p50']:.0f} ms, errors {row['errors']}, "
                    f"cached {row['cached']:g} of {row['looked_up']:g} prompt tokens")
            say(f"{strategy} routers, overhead so far: {overhead(routers)}")   # before they roll
            for router in routers:
                (out / f"router-{strategy}-r{round_}-{router.split('//')[1].split(':')[0]}.metrics").write_text(
                    httpx.get(f"{router}/metrics", timeout=30).text)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    say("\nprefix-aware against the others, same round (shared-prefix: throughput, TTFT p50; random: req/s):")
    for round_ in range(1, args.rounds + 1):
        get = {(r["strategy"], r["dataset"]): r for r in rows if r["round"] == round_}
        pa, rr, ll = (get[(s, "shared-prefix")] for s in STRATEGIES)
        say(f"r{round_}: throughput {pa['req_s'] / rr['req_s']:.2f}x round-robin, {pa['req_s'] / ll['req_s']:.2f}x "
            f"least-load; TTFT p50 {pa['ttft_p50'] / rr['ttft_p50']:.2f}x round-robin; random "
            f"{get[('prefix-aware', 'random')]['req_s'] / get[('least-load', 'random')]['req_s']:.2f}x least-load")
    randoms = {s: [r["req_s"] for r in rows if r["strategy"] == s and r["dataset"] == "random"] for s in STRATEGIES}
    say("random req/s medians: " + ", ".join(f"{s} {statistics.median(v):.2f}" for s, v in randoms.items()))
    kube.kubectl("delete", "namespace", ns, "--wait=false")
    return 0


if __name__ == "__main__":
    sys.exit(main())
