"""Smoke tests of the local cluster: GPU scheduling on the fake nodes, kubectl and helm."""
from __future__ import annotations

import ipaddress
import json
import textwrap
from pathlib import Path

import pytest

from e2e.localcluster.binaries import PINS
from e2e.helpers import Cluster, wait_for
from e2e.localcluster.nodes import node_name

pytestmark = pytest.mark.e2e
GPU_NODES = "nvidia.com/gpu.present=true"

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-workload}
spec:
  replicas: 3
  selector: {matchLabels: {app: gpu-workload}}
  template:
    metadata: {labels: {app: gpu-workload}}
    spec:
      nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
      containers:
      - name: main
        image: registry.k8s.io/pause:3.10
        resources: {limits: {nvidia.com/gpu: 2}}
"""


def test_fake_gpu_nodes_are_ready_with_eight_gpus(cluster: Cluster) -> None:
    nodes = {n.metadata.name: n for n in cluster.core.list_node(label_selector=GPU_NODES).items}
    for node in nodes.values():
        assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    if cluster.local:
        assert set(nodes) == {node_name(i) for i in range(cluster.config.gpu_nodes)}
        for node in nodes.values():
            assert ipaddress.ip_network(node.spec.pod_cidr).subnet_of(ipaddress.ip_network("127.0.0.0/8"))
        assert cluster.kubectl_json("version")["serverVersion"]["gitVersion"] == PINS.kubernetes
    assert nodes


def test_deployment_requesting_gpus_runs_on_fake_gpu_nodes(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=DEPLOYMENT)
    cluster.kubectl("rollout", "status", "-n", namespace, "deployment/gpu-workload", "--timeout=60s")
    pods = cluster.pods(namespace, "app=gpu-workload")
    assert len(pods) == 3
    for pod in pods:
        assert pod.status.phase == "Running"
        assert cluster.core.read_node(pod.spec.node_name).metadata.labels["nvidia.com/gpu.present"] == "true"
        assert ipaddress.ip_address(pod.status.pod_ip).is_loopback or not cluster.local
    assert len({p.status.pod_ip for p in pods}) == 3


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(cluster: Cluster, namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big"},
           "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                    "resources": {"limits": {"nvidia.com/gpu": "9"}}}]}}
    cluster.core.create_namespaced_pod(namespace, pod)

    def failed_scheduling() -> list:
        events = cluster.core.list_namespaced_event(namespace, field_selector="involvedObject.name=too-big").items
        return [e for e in events if e.reason == "FailedScheduling"]

    event = wait_for(failed_scheduling, "a FailedScheduling event for pod too-big", timeout=30)[0]
    assert "Insufficient nvidia.com/gpu" in event.message
    assert cluster.core.read_namespaced_pod("too-big", namespace).status.phase == "Pending"


def test_helm_installs_a_chart(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "throwaway"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: throwaway\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\nreplicas: 2\n")
    (chart / "templates" / "all.yaml").write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata: {name: {{ .Release.Name }}-config}
        data: {greeting: {{ .Values.greeting | quote }}}
        ---
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: {{ .Release.Name }}}
        spec:
          replicas: {{ .Values.replicas }}
          selector: {matchLabels: {app: {{ .Release.Name }}}}
          template:
            metadata: {labels: {app: {{ .Release.Name }}}}
            spec:
              containers: [{name: main, image: registry.k8s.io/pause:3.10}]
        """))
    cluster.helm("install", "demo", str(chart), "-n", namespace, "--set", "greeting=hi", "--wait", "--timeout", "60s")
    releases = {r["name"]: r for r in json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)}
    assert releases["demo"]["status"] == "deployed"
    assert cluster.core.read_namespaced_config_map("demo-config", namespace).data == {"greeting": "hi"}
    assert cluster.apps.read_namespaced_deployment("demo", namespace).status.ready_replicas == 2
    cluster.helm("uninstall", "demo", "-n", namespace, "--wait")
