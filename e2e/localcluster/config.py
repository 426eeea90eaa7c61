"""Where the local cluster lives and which loopback ports and address ranges it uses."""
from __future__ import annotations

import ipaddress
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from .binaries import CACHE

# What selects a cluster (and the cache its binaries come from): a second cluster's shell needs them.
CLUSTER_ENV = ("KUBEINFER_CACHE", "KUBEINFER_CLUSTER_DIR", "KUBEINFER_CLUSTER_PORT_BASE", "KUBEINFER_CLUSTER_POD_CIDR")
# `make test`'s own cluster when none is chosen: never the one `make demo`/`cluster-up` use.
TEST_CLUSTER_ENV = {"KUBEINFER_CLUSTER_DIR": str(CACHE / "cluster-test"), "KUBEINFER_CLUSTER_PORT_BASE": "62000",
                    "KUBEINFER_CLUSTER_POD_CIDR": "127.3.0.0/16"}


def use_test_cluster(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Point this process (and its children) at the test cluster unless a cluster was chosen
    explicitly (any KUBEINFER_CLUSTER_* set); True when it did."""
    if any(name in environ for name in TEST_CLUSTER_ENV):
        return False
    environ.update(TEST_CLUSTER_ENV)
    return True


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@dataclass(frozen=True)
class ClusterConfig:
    """Everything binds to 127.0.0.1. Pod IPs come from 127.1.0.0/16 (one /24 per node) and
    Service IPs from 127.96.0.0/16: loopback only, so no traffic can ever leave the machine.
    Ports start above Linux's ephemeral range (32768-60999), so no client socket can hold one.
    A second cluster on the same machine needs its own KUBEINFER_CLUSTER_DIR, _PORT_BASE and
    _POD_CIDR (e.g. 127.2.0.0/16), or pods of both could collide on an IP and port."""

    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("KUBEINFER_CLUSTER_DIR", CACHE / "cluster")))
    port_base: int = field(default_factory=lambda: _env_int("KUBEINFER_CLUSTER_PORT_BASE", 61400))
    gpu_nodes: int = field(default_factory=lambda: _env_int("KUBEINFER_CLUSTER_NODES", 2))
    service_cidr: str = "127.96.0.0/16"
    service_ip: str = "127.96.0.1"  # the `kubernetes` Service: first address of the range
    pod_cidr: str = field(default_factory=lambda: os.environ.get("KUBEINFER_CLUSTER_POD_CIDR", "127.1.0.0/16"))
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpus_per_node: int = 8

    @property
    def ports(self) -> dict[str, int]:
        names = ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
        return {name: self.port_base + i for i, name in enumerate(names)}

    @property
    def service_ports(self) -> range:
        """Loopback ports the local service proxy hands to Services (e2e/localcluster/svcproxy.py)."""
        return range(self.port_base + 10, self.port_base + 100)

    @property
    def service_table(self) -> Path:
        """Which Service port the service proxy serves on which loopback port (JSON)."""
        return self.state_dir / "services.json"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig printed by `up`; tests and kubectl use it."""
        return self.state_dir / "pki" / "admin.kubeconfig"

    def node_pod_cidr(self, index: int) -> str:
        """The /24 of node ``index`` inside ``pod_cidr`` (the first /24 is left unused)."""
        network = ipaddress.ip_network(self.pod_cidr)
        return str(next(itertools.islice(network.subnets(new_prefix=24), index + 1, None)))
