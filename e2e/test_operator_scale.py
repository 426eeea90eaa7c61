"""100 InferenceServices applied at once all reach Ready (pods simulated by kwok).

Prints the time to all-Ready and the operator's resident memory, the figures BENCHMARKS.md
records; the test asserts only the behaviour (every one Ready, one Deployment each).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from e2e.localcluster.config import ClusterConfig
from e2e.helpers import SYSTEM_NS, Cluster, wait_for

pytestmark = pytest.mark.e2e
COUNT = 100


def operator_rss_mib(cluster: Cluster) -> float | None:
    """Resident memory of the operator process the local pod runner started (from its pid file)."""
    pid_dir = ClusterConfig().state_dir / "pids"
    for pod in cluster.pods(SYSTEM_NS, "app.kubernetes.io/component=operator"):
        for pid_file in pid_dir.glob(f"pod-{SYSTEM_NS}_{pod.metadata.name}-operator.pid"):
            status = Path(f"/proc/{pid_file.read_text().split()[0]}/status")  # "pid starttime"
            if status.exists():
                rss = next(line for line in status.read_text().splitlines() if line.startswith("VmRSS"))
                return int(rss.split()[1]) / 1024
    return None


def test_hundred_services_reach_ready(cluster: Cluster, namespace: str) -> None:
    cluster.install_chart()
    docs = [{"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": f"svc-{i:03d}"},
             "spec": {"engine": {"image": "registry.example.com/simulated-engine:1", "device": "cpu"},
                      "resources": {"cpu": "100m", "memory": "128Mi"},
                      # engines only, as when BENCHMARKS.md recorded these figures (no router pods)
                      "routing": {"strategy": "none"}}} for i in range(COUNT)]
    started = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(docs))

    def ready_count() -> int | None:
        items = cluster.kubectl_json("get", "inferenceservices", "-n", namespace)["items"]
        ready = sum(any(c["type"] == "Ready" and c["status"] == "True"
                        for c in (i.get("status") or {}).get("conditions", [])) for i in items)
        return ready if ready == COUNT else None

    wait_for(ready_count, f"{COUNT} InferenceServices Ready", timeout=900, interval=5)
    elapsed = time.monotonic() - started
    deployments = cluster.kubectl_json("get", "deployments", "-n", namespace)["items"]
    assert len(deployments) == COUNT
    rss = operator_rss_mib(cluster)
    print(f"\n{COUNT} InferenceServices all Ready in {elapsed:.1f} s; operator RSS "
          f"{'unknown' if rss is None else f'{rss:.0f} MiB'}")
