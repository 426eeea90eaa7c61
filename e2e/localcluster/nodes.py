"""Fake GPU nodes: labelled and sized like an 8xH100 cloud node, run by kwok.

Why status is written by us before kwok starts: kwok's node-initialize stage keeps an existing
``status.capacity``/``allocatable``, so the scheduler sees ``nvidia.com/gpu: 8`` from the start.
No taint: real GPU nodes often carry ``nvidia.com/gpu:NoSchedule``, but then every test pod would
need a toleration; nodeSelector on the labels below works the same way.
"""
from __future__ import annotations

from kubernetes import client

from .config import ClusterConfig

INSTANCE_TYPE = "p5.48xlarge"  # 8x H100 80GB, 192 vCPU, 2 TiB


def node_name(index: int) -> str:
    return f"kubeinfer-gpu-{index}"


def manifest(cfg: ClusterConfig, index: int) -> dict:
    name = node_name(index)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "type": "kwok",  # kwok manages nodes with this label (see components.kwok)
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": INSTANCE_TYPE,
                "topology.kubernetes.io/zone": "local-a",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": cfg.gpu_product,
                "nvidia.com/gpu.count": str(cfg.gpus_per_node),
                "nvidia.com/gpu.memory": "81559",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": cfg.node_pod_cidr(index), "podCIDRs": [cfg.node_pod_cidr(index)]},
    }


def status(cfg: ClusterConfig) -> dict:
    resources = {"cpu": "192", "memory": "2048Gi", "pods": "110", "ephemeral-storage": "7500Gi",
                 "nvidia.com/gpu": str(cfg.gpus_per_node)}
    return {"status": {"capacity": resources, "allocatable": resources}}  # kwok adds InternalIP 127.0.0.1


def create_all(api: client.CoreV1Api, cfg: ClusterConfig) -> list[str]:
    names = []
    for index in range(cfg.gpu_nodes):
        body = manifest(cfg, index)
        api.create_node(body)
        api.patch_node_status(body["metadata"]["name"], status(cfg))
        names.append(body["metadata"]["name"])
    return names
