"""Helpers for e2e tests: kubectl/helm against the local cluster and waiting with deadlines."""
from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kubernetes import client

from e2e.localcluster.binaries import binary
from e2e.localcluster.config import ClusterConfig

T = TypeVar("T")
CHART = Path(__file__).resolve().parents[1] / "helm" / "kubeinfer"
RELEASE, SYSTEM_NS = "kubeinfer", "kubeinfer-system"
HELM_WAIT = 300  # seconds helm waits for the release's pods
TEST_RELEASE_DESCRIPTION = "installed by kubeinfer's e2e tests"  # how tests recognise their own release


def wait_for(fetch: Callable[[], T | None], what: str, timeout: float = 60.0, interval: float = 0.5) -> T:
    """Poll ``fetch`` until it returns something truthy and return that; on timeout the error
    names ``what`` and the last value seen, so a failing test says what it was waiting for."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = fetch()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last value: {last!r}")


@dataclass
class Cluster:
    """What the `cluster` fixture yields."""

    config: ClusterConfig
    api: client.ApiClient
    kubeconfig: Path
    local: bool = True  # False: an external cluster (KUBEINFER_E2E_KUBECONFIG), e.g. kind

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    def _run(self, argv: list[str], stdin: str | None, check: bool,
             timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return self._run(["kubectl", f"--kubeconfig={self.kubeconfig}", *args], stdin, check)

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """helm may wait up to HELM_WAIT for pods (`--wait --timeout`), so allow it longer."""
        return self._run([str(binary("helm")), f"--kubeconfig={self.kubeconfig}", *args], None,
                         check, timeout=HELM_WAIT + 60)

    def install_chart(self, *sets: str, chart: Path = CHART) -> None:
        """`helm upgrade --install` the operator chart with its defaults plus `sets`.

        Every e2e module installs the CRD this way, so the release owns it and the next
        module's upgrade can adopt it; an upgrade another test session has in flight is
        waited out rather than failing.
        """
        def upgrade() -> bool:
            result = self.helm("upgrade", "--install", RELEASE, str(chart), "--namespace",
                               SYSTEM_NS, "--create-namespace", "--reset-values", "--wait",
                               "--timeout", f"{HELM_WAIT}s", "--description", TEST_RELEASE_DESCRIPTION,
                               *[arg for s in sets for arg in ("--set", s)], check=False)
            assert result.returncode == 0 or "another operation" in result.stderr, \
                f"helm upgrade --install failed:\n{result.stderr}{result.stdout}\n{self.pod_report(SYSTEM_NS)}"
            return result.returncode == 0
        wait_for(upgrade, "helm upgrade of the operator chart", timeout=HELM_WAIT, interval=5)

    def pods(self, namespace: str, selector: str = "") -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(namespace, label_selector=selector).items

    def pod_report(self, namespace: str, selector: str = "", log_lines: int = 6) -> str:
        """Each pod's IP, phase, unmet conditions and container states, and on the local cluster
        the last lines of each container's log: what a timeout waiting on pods should say, as
        CI keeps only the failure's text."""
        lines = []
        for pod in self.pods(namespace, selector):
            unmet = [f"{c.type}={c.status}({c.reason or ''})" for c in pod.status.conditions or [] if c.status != "True"]
            lines.append(f"pod {pod.metadata.name} ip={pod.status.pod_ip} phase={pod.status.phase} "
                         f"unmet={unmet}")
            for status in pod.status.container_statuses or []:
                state = {k: v for k, v in status.state.to_dict().items() if v}
                lines.append(f"  {status.name}: ready={status.ready} restarts={status.restart_count} {state}")
                log = self.config.state_dir / "pods" / f"{namespace}_{pod.metadata.name}" / f"{status.name}.log"
                if self.local and log.exists():
                    tail = log.read_bytes().splitlines()[-log_lines:]
                    lines.extend(f"    | {line.decode(errors='replace')[:300]}" for line in tail)
        return "\n".join(lines) or f"no pods in {namespace} match {selector!r}"


def foreign_release(cluster: Cluster) -> str:
    """Why the cluster's `kubeinfer` release is not the tests' own ("" when it is, or there is none)."""
    result = cluster.helm("history", RELEASE, "--namespace", SYSTEM_NS, "--max", "1", "-o", "json", check=False)
    if result.returncode:  # no such release
        return ""
    last = json.loads(result.stdout)[-1]
    if last.get("description") == TEST_RELEASE_DESCRIPTION:
        return ""
    return (f"Helm release {SYSTEM_NS}/{RELEASE} revision {last.get('revision')} was not installed by the tests "
            f"({last.get('description')!r})")


def pod_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
