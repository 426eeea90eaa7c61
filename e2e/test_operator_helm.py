"""The chart's lifecycle on the local cluster: upgrade carries CRD changes, uninstall removes
the operator but keeps the CRD (and so every InferenceService)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from e2e.helpers import CHART, RELEASE, SYSTEM_NS, Cluster, wait_for

pytestmark = pytest.mark.e2e
CRD = "inferenceservices.kubeinfer.io"


def install(cluster: Cluster, chart: Path, *sets: str) -> None:
    """Chart defaults plus `sets` (helm would otherwise reuse the last release's values)."""
    cluster.install_chart(*sets, chart=chart)


def crd_columns(cluster: Cluster) -> list[str]:
    crd = cluster.kubectl_json("get", "crd", CRD)
    return [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]


def test_upgrade_updates_the_crd(cluster: Cluster, tmp_path: Path) -> None:
    install(cluster, CHART)
    changed = tmp_path / "kubeinfer"
    shutil.copytree(CHART, changed)
    crd_file = changed / "files" / "crds" / f"{CRD}.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Dtype", "type": "string", "jsonPath": ".spec.model.dtype", "priority": 1})
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    try:
        install(cluster, changed)
        assert crd_columns(cluster)[-1] == "Dtype"
    finally:
        install(cluster, CHART)
    assert "Dtype" not in crd_columns(cluster)


def test_namespaced_install_serves_its_namespace_with_roles(cluster: Cluster,
                                                            namespace: str) -> None:
    isvc = {"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "scoped"},
            "spec": {"engine": {"image": "registry.example.com/simulated-engine:1", "device": "cpu"}}}
    try:
        install(cluster, CHART, f"watch.namespaces={{{namespace}}}")
        assert cluster.kubectl_json("get", "role", "kubeinfer", "-n", namespace)["rules"]
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(isvc))
        wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in
                             (cluster.kubectl_json("get", "kis", "scoped", "-n", namespace)
                              .get("status") or {}).get("conditions", [])),
                 "namespaced operator makes it Ready", timeout=120)
    finally:
        install(cluster, CHART)


def test_helm_test_hook_passes_and_shows_its_log(cluster: Cluster) -> None:
    install(cluster, CHART)
    result = cluster.helm("test", RELEASE, "--namespace", SYSTEM_NS, "--timeout", "2m", "--logs")
    assert "Phase:          Succeeded" in result.stdout, result.stdout
    assert re.search(r"POD LOGS: kubeinfer-test\n.*/healthz 200", result.stdout), result.stdout


def test_uninstall_removes_the_operator_and_keeps_the_crd(cluster: Cluster) -> None:
    install(cluster, CHART)
    selector = "app.kubernetes.io/component=operator"
    cluster.helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait")
    wait_for(lambda: not cluster.pods(SYSTEM_NS, selector), "operator pods gone", timeout=90)
    assert not cluster.kubectl_json("get", "deployment", "-n", SYSTEM_NS, "-l", selector)["items"]
    assert cluster.kubectl_json("get", "crd", CRD)["metadata"]["name"] == CRD
    install(cluster, CHART)  # leave the operator running for the modules after this one
