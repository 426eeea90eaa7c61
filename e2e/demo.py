"""``python -m e2e.demo`` (``make demo``): the whole story on one machine, stage by stage.

Local cluster up (or reused) -> the Helm chart installed -> the embedded-model example applied
and Ready -> a chat completion through its pod IP -> how to query it again. Demo infrastructure,
not product: the cluster stays up afterwards (that is the point) unless ``--down`` is given.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai import OpenAI

from e2e.localcluster import cluster as cluster_mod, processes, svcproxy
from e2e.localcluster.binaries import BUILDERS, CACHE, OPT_IN, PROGRESS_SECONDS, bin_dir, ensure_all
from e2e.localcluster.config import CLUSTER_ENV, ClusterConfig
from e2e.helpers import Cluster, pod_ready

REPO = Path(__file__).resolve().parents[1]
CHART, EXAMPLE = REPO / "helm" / "kubeinfer", REPO / "crds" / "examples" / "embedded-model.yaml"
RELEASE, SYSTEM_NS, CRD = "kubeinfer", "kubeinfer-system", "inferenceservices.kubeinfer.io"
OPERATOR_PODS = f"app.kubernetes.io/component=operator,app.kubernetes.io/instance={RELEASE}"
STAGES = 5
DEGRADED_GRACE = 90.0  # Degraded this long means waiting will not fix it


class StageFailed(RuntimeError):
    """A stage gave up; ``details`` is what the user reads to find out why."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


@contextmanager
def stage(number: int, title: str, diagnose: Callable[[], str] = lambda: "") -> Iterator[None]:
    print(f"\n[{number}/{STAGES}] {title}", flush=True)
    start = time.monotonic()
    try:
        yield
    except Exception as err:  # any failure of a stage ends the demo with that stage's diagnostics
        try:
            details = diagnose()
        except Exception as diag_err:
            details = f"(no diagnostics: {diag_err})"
        raise StageFailed(f"stage {number}/{STAGES} ({title}) failed: {err}", details) from err
    print(f"      done in {time.monotonic() - start:.0f} s", flush=True)


def wait_reporting(check: Callable[[], tuple[bool, str]], what: str, timeout: float) -> None:
    """Poll ``check`` -> (done, state); print each new state and a heartbeat so nothing looks hung."""
    start = beat = time.monotonic()
    last = ""
    while (elapsed := time.monotonic() - start) < timeout:
        done, state = check()
        if state != last or time.monotonic() - beat >= 30:
            print(f"      {elapsed:4.0f} s  {state}", flush=True)
            last, beat = state, time.monotonic()
        if done:
            return
        time.sleep(2)
    raise TimeoutError(f"{what} not reached after {timeout:.0f} s (last: {last})")


def build_binaries() -> None:
    missing = [c for c in BUILDERS if c not in OPT_IN and not (bin_dir(c) / ".built").exists()]
    absent = [tool for tool in ["kubectl"] + ["go"] * bool(missing) if not shutil.which(tool)]
    if absent:
        raise RuntimeError(f"{' and '.join(absent)} not on PATH: the demo needs kubectl (1.32+) and, to build the "
                           "cluster's binaries the first time, Go 1.24+")
    if not missing:
        print(f"      Kubernetes binaries cached in {CACHE / 'bin'}")
        return
    print(f"      first run: building {', '.join(missing)} from the Go module proxy into {CACHE / 'bin'}\n"
          f"      (13.5 min cold measured on 2 busy cores, Kubernetes 9.3 of them; progress every "
          f"{PROGRESS_SECONDS:.0f} s; logs: {CACHE / 'build'}/<component>-<version>.log)", flush=True)
    ensure_all()


def bring_up_cluster(cfg: ClusterConfig) -> bool:
    """True when this run started the cluster, False when it reused a healthy one."""
    with cluster_mod.locked(cfg):
        seconds = cluster_mod.up(cfg)
        (cfg.state_dir / "started-by-pytest").unlink(missing_ok=True)  # like `make cluster-up`: it stays up
    print("      reused the running cluster" if seconds == 0 else f"      cluster up in {seconds:.0f} s")
    return seconds > 0


def pod_logs(cfg: ClusterConfig, namespace: str, lines: int = 15) -> str:
    """The tail of every runner pod's log in ``namespace`` (the runner writes them; no kubelet here)."""
    tails = []
    for path in sorted((cfg.state_dir / "pods").glob(f"{namespace}_*/*.log")):
        with open(path, errors="replace") as log:
            tails.append(f"--- {path} (last {lines} lines)\n" + "".join(deque(log, maxlen=lines)))
    return "".join(tails)


def pod_summary(pods: list[Any]) -> str:
    return ", ".join(f"{p.metadata.name} {p.status.phase}{' Ready' if pod_ready(p) else ''}" for p in pods)


def operator_state(kube: Cluster) -> tuple[bool, str]:
    deps = kube.apps.list_namespaced_deployment(SYSTEM_NS, label_selector=OPERATOR_PODS).items
    pods = pod_summary(kube.pods(SYSTEM_NS, OPERATOR_PODS))
    if any(d.spec.replicas == 0 for d in deps):
        return False, f"the operator Deployment is scaled to 0 (chart value replicaCount); pods: {pods or 'none'}"
    done = bool(deps) and all(d.status.observed_generation == d.metadata.generation
                              and (d.status.updated_replicas or 0) == d.spec.replicas == (d.status.ready_replicas or 0)
                              and (d.status.replicas or 0) == d.spec.replicas for d in deps)
    return done, f"operator pods: {pods or 'none yet'}"


def install_chart(kube: Cluster, *flags: str) -> None:
    print(f"      helm upgrade --install {RELEASE} {CHART.relative_to(REPO)} -n {SYSTEM_NS}", flush=True)
    kube.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", SYSTEM_NS, "--create-namespace",
              "--reset-then-reuse-values", *flags)  # keeps values someone set on an existing release
    kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")
    wait_reporting(lambda: operator_state(kube), "operator Ready", timeout=300)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def service_state(kube: Cluster, namespace: str, name: str) -> tuple[bool, str]:
    obj = kube.kubectl_json("get", "inferenceservice", name, "-n", namespace)
    ready, degraded = condition(obj, "Ready"), condition(obj, "Degraded")
    if degraded.get("status") == "True":
        since = datetime.fromisoformat(degraded["lastTransitionTime"].replace("Z", "+00:00"))
        if (datetime.now(timezone.utc) - since).total_seconds() > DEGRADED_GRACE:
            raise RuntimeError(f"Degraded ({degraded['reason']}): {degraded['message']}")
    status = obj.get("status") or {}
    pods = pod_summary(kube.pods(namespace, status["selector"])) if status.get("selector") else ""
    state = f"Ready={ready.get('status', '?')} {ready.get('reason', '')}: {ready.get('message', 'no status yet')}" \
        + (f"; pods: {pods}" if pods else "")
    caught_up = status.get("observedGeneration") == obj["metadata"]["generation"]
    return ready.get("status") == "True" and caught_up, state


def apply_example(kube: Cluster, namespace: str, timeout: float) -> dict[str, Any]:
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    print(f"      kubectl apply -n {namespace} -f {EXAMPLE.relative_to(REPO)}", flush=True)
    kube.kubectl("create", "namespace", namespace, check=False)  # exists already: fine
    kube.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
    wait_reporting(lambda: service_state(kube, namespace, name), f"{namespace}/{name} Ready", timeout)
    print(kube.kubectl("get", "kis", name, "-n", namespace, "-o", "wide").stdout, end="")
    return kube.kubectl_json("get", "inferenceservice", name, "-n", namespace)


def service_url(kube: Cluster, isvc: dict[str, Any], timeout: float = 60) -> str:
    """The local service proxy's URL for the InferenceService's Service, once it has a Ready pod."""
    ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]

    def check() -> tuple[bool, str]:
        rows = [r for r in svcproxy.read_table(kube.config.service_table)
                if (r["namespace"], r["name"]) == (ns, name) and r["serving"]]
        if not rows:
            return False, f"waiting for the local service proxy to serve {ns}/{name}"
        return bool(rows[0]["endpoints"]), f"{ns}/{name} on http://{rows[0]['local']}: " \
            f"endpoints {', '.join(rows[0]['endpoints']) or 'none Ready yet'}"
    wait_reporting(check, f"{ns}/{name} reachable from this machine", timeout)
    url = svcproxy.local_url(kube.config.service_table, ns, name)
    assert url is not None
    return url


def chat(kube: Cluster, isvc: dict[str, Any], prompt: str) -> tuple[str, str]:
    """(base URL, served model) after one chat completion through the Service's local URL."""
    base = service_url(kube, isvc) + "/v1"
    with httpx.Client(trust_env=False) as http:  # loopback only: never through a configured proxy
        api = OpenAI(base_url=base, api_key="unused", http_client=http, timeout=300, max_retries=0)
        model = api.models.list().data[0].id
        print(f"      POST {base}/chat/completions  model={model}\n      > {prompt}", flush=True)
        start = time.monotonic()
        reply = api.chat.completions.create(model=model, max_tokens=64,
                                            messages=[{"role": "user", "content": prompt}])
    answer = (reply.choices[0].message.content or "").strip()
    if not answer:
        raise RuntimeError(f"empty answer (finish_reason={reply.choices[0].finish_reason})")
    print(f"      < {answer}\n      ({reply.usage.completion_tokens} tokens in {time.monotonic() - start:.1f} s,"
          f" finish_reason={reply.choices[0].finish_reason})")
    return base, model


def env_line() -> str:
    """The line that gives a shell this cluster's kubectl, helm and kubeinfer (`make env`)."""
    settings = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in CLUSTER_ENV if k in os.environ)
    here = "" if Path.cwd().resolve() == REPO else f"-C {shlex.quote(str(REPO))} "
    return f'eval "$({settings}make -s {here}env)"'


def next_steps(cfg: ClusterConfig, isvc: dict[str, Any], base: str, model: str) -> None:
    ns, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
    env = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in CLUSTER_ENV if k in os.environ)
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}]}' % model
    print(f"""      {env_line()}   # kubectl, helm, kubeinfer and KUBECONFIG in this shell
      kubectl get kis -n {ns} -o wide
      kubectl logs -n {ns} deploy/{name}
      curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
        -d '{body}'
      ({base} is Service {ns}/{name} through the local service proxy; `make cluster-status` lists them all.
       Or: kubectl port-forward -n {ns} svc/{name} 8000:80, then http://localhost:8000/v1)
      tear down: {env}make cluster-down""")


def tear_down(cfg: ClusterConfig, kube: Cluster, started: bool, namespace: str, name: str) -> None:
    """Stop the cluster only if this run started it and no test session uses it now."""
    with cluster_mod.locked(cfg):
        users = [s for s in (cfg.state_dir / "sessions").glob("*") if processes.pid_alive(int(s.name))]
        if started and not users:
            print(f"\n--down: stopped pids {cluster_mod.down(cfg)}")
            return
    kube.kubectl("delete", "inferenceservice", name, "-n", namespace, "--wait=true")
    why = f"{len(users)} test session(s) use it" if users else "it was running before the demo"
    print(f"\n--down: deleted {namespace}/{name}; left the cluster running ({why}); `make cluster-down` stops it")


def describe(kube: Cluster, *what: str) -> str:
    return kube.kubectl("describe", *what, check=False).stdout


def run(args: argparse.Namespace, cfg: ClusterConfig) -> None:
    with stage(1, "local Kubernetes cluster",
               lambda: f"cluster logs: {cfg.state_dir / 'logs'}"):
        build_binaries()
        started = bring_up_cluster(cfg)
    kube, ns = Cluster(cfg, cluster_mod.api_client(cfg), cfg.kubeconfig), args.namespace
    with stage(2, "kubeinfer operator (Helm chart)",
               lambda: describe(kube, "pods", "-n", SYSTEM_NS, "-l", OPERATOR_PODS) + pod_logs(cfg, SYSTEM_NS)):
        install_chart(kube)
    with stage(3, "InferenceService from the embedded-model example",
               lambda: describe(kube, "inferenceservice", "-n", ns) + describe(kube, "pods", "-n", ns)
               + pod_logs(cfg, ns)):
        isvc = apply_example(kube, ns, args.timeout)
    with stage(4, "chat completion (OpenAI API, through the Service)", lambda: pod_logs(cfg, ns)):
        base, model = chat(kube, isvc, args.prompt)
    with stage(5, "query it again"):
        next_steps(cfg, isvc, base, model)
    if args.down:
        tear_down(cfg, kube, started, ns, isvc["metadata"]["name"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description="Bring up the local cluster, install "
                                     "the chart, serve the embedded model and send it a chat completion.")
    parser.add_argument("--namespace", default="default", help="where the example InferenceService goes")
    parser.add_argument("--prompt", default="Explain Kubernetes in one sentence.")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the model to be Ready")
    parser.add_argument("--down", action="store_true", help="stop the cluster afterwards (if this run started it)")
    args, cfg, start = parser.parse_args(argv), ClusterConfig(), time.monotonic()
    try:
        run(args, cfg)
    except StageFailed as err:
        print(f"\nerror: {err}\n{err.details}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; whatever started keeps running (`python -m e2e.localcluster status`)", file=sys.stderr)
        return 130
    print(f"\ndemo finished in {time.monotonic() - start:.0f} s")
    if not args.down:
        print(f"kubectl, helm and kubeinfer for this cluster in your shell:\n{env_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
