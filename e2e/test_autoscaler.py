"""The built-in autoscaler on the local cluster, with real engine pods under real load.

A `kubeinfer operator --namespace <ns> --standalone` process (the reconciler plus the
autoscaler daemon) watches a fresh namespace; a `kubeinfer gateway` process on 127.0.0.1 spreads
`kubeinfer bench serve` load over the Ready engine pods (their loopback IPs), since the local
cluster has no kube-proxy to do it for the Service. Intervals and delays are seconds, not
minutes, to fit a test run. Scale to zero: e2e/test_scale_to_zero.py.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.helpers import Cluster, wait_for

pytestmark = pytest.mark.e2e
INTERVAL, WINDOW, DELAY = 5, 10, 30


def manifest(name: str, **autoscaling: Any) -> str:
    spec = {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
            "engine": {"device": "cpu", "kvCacheMemory": "64Mi", "maxNumSeqs": 2,
                       "maxNumBatchedTokens": 256},
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1,
            "autoscaling": {"enabled": True, "metric": "queueDepth", "target": 2,
                            "intervalSeconds": INTERVAL, "windowSeconds": WINDOW,
                            "scaleDownDelaySeconds": DELAY, **autoscaling}}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": name}, "spec": spec})


class Background:
    """A child process with its output in a log file; stopped by its own pid only."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.argv, self.log, self.env = argv, log, env
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def env(local_cluster: Cluster) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(local_cluster.kubeconfig)}


@pytest.fixture
def operator(local_cluster: Cluster, namespace: str, env: dict[str, str],
             tmp_path: Path) -> Iterator[Background]:
    # The chart owns the CRD (so later modules can upgrade it); its operator is scaled to
    # zero so only this test's process, which it restarts at will, acts on the namespace.
    local_cluster.install_chart("replicaCount=0")
    argv = [sys.executable, "-m", "kubeinfer.server.cli", "operator", "--namespace", namespace,
            "--standalone", "--bind-address", "127.0.0.1", "--health-port", str(free_port()),
            "--metrics-port", "0"]
    process = Background(argv, tmp_path / "operator.log", env)
    yield process
    if process.process and process.process.poll() is not None:
        process.start()  # the autoscaler's kopf finalizer needs a live operator to go away
    local_cluster.kubectl("delete", "inferenceservices", "--all", "-n", namespace, "--wait",
                          "--timeout=120s", check=False)
    process.stop()
    local_cluster.install_chart()  # the chart's operator back, for the modules after this one


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_gateway(namespace: str, name: str, env: dict[str, str],
                  log: Path) -> tuple[Background, str]:
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from kubeinfer.server.router import cli; "
            "import argparse; p = argparse.ArgumentParser(); cli.add_arguments(p); "
            "sys.exit(cli.run(p.parse_args(sys.argv[1:])))",
            "--inferenceservice", name, "--namespace", namespace, "--host", "127.0.0.1",
            "--port", str(port), "--activation-timeout", "600", "--log-level", "warning"]
    gateway = Background(argv, log, env)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _get(f"{url}/healthz"), "the gateway's /healthz", timeout=60)
    return gateway, url


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


def isvc(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", name, "-n", namespace)


def scale_events(cluster: Cluster, namespace: str, name: str) -> list[tuple[float, str, str]]:
    """(time, ScaledUp|ScaledDown, message) of the autoscaler's Events, oldest first."""
    events = cluster.kubectl_json("get", "events", "-n", namespace,
                                  "--field-selector", f"involvedObject.name={name}")["items"]
    found = [(_unix(e.get("eventTime") or e.get("lastTimestamp") or
                    e["metadata"]["creationTimestamp"]), e["reason"], e["message"])
             for e in events if e["reason"] in ("ScaledUp", "ScaledDown")]
    return sorted(found)


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Timeline(threading.Thread):
    """Samples replicas and the autoscaler's readings every second (for asserts and the plot)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.rows: list[dict[str, Any]] = []
        self.readings: dict[float, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            obj = isvc(self.cluster, self.namespace, self.name)
            status = obj.get("status") or {}
            for sample in (status.get("autoscaler") or {}).get("samples", []):
                self.readings[_unix(sample["time"])] = sample["value"]
            self.rows.append({"time": time.time(), "replicas": obj["spec"]["replicas"],
                              "ready": status.get("readyReplicas", 0),
                              "belowSince": (status.get("autoscaler") or {}).get("belowSince")})

    def clock_before(self, moment: float) -> float | None:
        """The scale-down clock (status belowSince) last seen before `moment`."""
        seen = [r["belowSince"] for r in self.rows if r["time"] < moment and r["belowSince"]]
        return _unix(seen[-1]) if seen else None

    def first_reading_above(self, value: float) -> float:
        return min(t for t, v in self.readings.items() if v > value)


def served_requests(cluster: Cluster, namespace: str) -> dict[str, float]:
    """vllm:request_success_total per engine pod, read from each pod's /metrics."""
    counts = {}
    for pod in cluster.pods(namespace, "app.kubernetes.io/component=engine"):
        page = _get(f"http://{pod.status.pod_ip}:8000/metrics") if pod.status.pod_ip else None
        if page is not None and page.status_code == 200:
            counts[pod.metadata.name] = sum(
                float(line.rsplit(" ", 1)[1]) for line in page.text.splitlines()
                if line.startswith("vllm:request_success_total"))
    return counts


def test_queue_growth_scales_up_then_down_after_the_delay_across_an_operator_restart(
        local_cluster: Cluster, namespace: str, operator: Background, env: dict[str, str],
        tmp_path: Path) -> None:
    name = "load"
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-",
                          stdin=manifest(name, minReplicas=1, maxReplicas=3))
    wait_for(lambda: (isvc(local_cluster, namespace, name).get("status") or {})
             .get("readyReplicas", 0) >= 1, "the first engine pod Ready", timeout=600, interval=2)
    gateway, url = start_gateway(namespace, name, env, tmp_path / "gateway.log")
    timeline = Timeline(local_cluster, namespace, name)
    timeline.start()
    bench = Background(
        [sys.executable, "-m", "kubeinfer.server.cli", "bench", "serve", "--base-url", url,
         "--concurrency", "8", "--num-prompts", "64", "--input-len", "32", "--output-len", "48",
         "--warmup", "0", "--no-progress"], tmp_path / "bench.log", env)
    # The load lasts until the pods it scaled up have served some of it (or it runs out), so the
    # scale-down phase starts as soon as the scale-up has shown what it is asserted to show; 64
    # prompts, because on a fast machine 24 ran out before a second pod was Ready.
    wait_for(lambda: bench.process.poll() is not None or sum(
                 1 for count in served_requests(local_cluster, namespace).values() if count > 0) >= 2,
             "requests served by a second engine pod", timeout=1800, interval=1)
    assert bench.process.poll() in (None, 0), (tmp_path / "bench.log").read_text()[-2000:]
    served = served_requests(local_cluster, namespace)
    bench.stop()
    load_ended = time.time()

    # The clock as it stands after the load (one may have started and reset during it).
    below = wait_for(lambda: timeline.rows and timeline.rows[-1]["time"] > load_ended
                     and timeline.rows[-1]["belowSince"], "the scale-down clock", timeout=120)
    below_since = _unix(below)
    time.sleep(max(0.0, below_since + DELAY / 2 - time.time()))
    operator.stop()  # restart mid-delay: the clock must continue from status, not restart
    restarted = time.time()
    operator.start()
    wait_for(lambda: isvc(local_cluster, namespace, name)["spec"]["replicas"] == 1,
             "the scale back to 1", timeout=DELAY * 3)
    timeline.halt.set()
    timeline.join()
    gateway.stop()
    (tmp_path / "timeline.json").write_text(json.dumps(
        {"rows": timeline.rows, "readings": sorted(timeline.readings.items())}))

    events = scale_events(local_cluster, namespace, name)
    directions = [reason for _, reason, _ in events]
    ups = directions.count("ScaledUp")
    assert ups >= 1 and directions == ["ScaledUp"] * ups + ["ScaledDown"] * (len(events) - ups), \
        f"flapped: {events}"
    first_up = events[0][0]
    assert first_up - timeline.first_reading_above(0) <= 2 * INTERVAL + 2, events[0]
    assert max(r["replicas"] for r in timeline.rows) >= 2
    assert sum(1 for count in served.values() if count > 0) >= 2, served  # new pods served
    downs = [t for t, reason, _ in events if reason == "ScaledDown"]
    assert downs[-1] >= load_ended + DELAY - 2, "back to 1 before the delay after the load"
    for down in downs:  # each step down followed scaleDownDelaySeconds of lower proposals
        clock = timeline.clock_before(down)
        assert clock is not None and clock <= down - DELAY + 2, (down, clock)
    after_restart = next(t for t, reason, _ in events if reason == "ScaledDown" and t > restarted)
    assert below_since + DELAY - 2 <= after_restart < restarted + DELAY, \
        "the restart reset the scale-down clock"
    assert "queueDepth" in events[0][2] and "target 2" in events[0][2]
