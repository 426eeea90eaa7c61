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

from e2e.binaries import binary
from e2e.config import ClusterConfig

T = TypeVar("T")


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

    def _run(self, argv: list[str], stdin: str | None, check: bool) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return self._run(["kubectl", f"--kubeconfig={self.kubeconfig}", *args], stdin, check)

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run([str(binary("helm")), f"--kubeconfig={self.kubeconfig}", *args], None, check)

    def pods(self, namespace: str, selector: str = "") -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(namespace, label_selector=selector).items


def pod_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
