"""`up`/`down` of a second, private cluster: clear port errors, reuse, and no process left behind."""
from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest

from e2e.localcluster import cluster as cluster_mod
from e2e.localcluster import processes
from e2e.localcluster.config import ClusterConfig
from e2e.helpers import Cluster, wait_for

pytestmark = pytest.mark.e2e


def private_config(tmp_path: Path) -> ClusterConfig:
    return replace(ClusterConfig(), state_dir=tmp_path / "cluster", port_base=61500, gpu_nodes=1,
                   pod_cidr="127.2.0.0/16")  # apart from the session cluster's pod IPs


def test_up_refuses_a_taken_port_with_a_clear_error(tmp_path: Path) -> None:
    cfg = private_config(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", cfg.ports["kube-apiserver"]))
        squatter.listen()
        with pytest.raises(processes.PortInUse, match=f"127.0.0.1:{cfg.ports['kube-apiserver']} .*kube-apiserver"):
            cluster_mod.up(cfg)
    assert not (cfg.state_dir / "pids").exists() or not processes.running(cfg.state_dir)


def test_down_stops_every_process_including_runner_pods(tmp_path: Path) -> None:
    cfg = private_config(tmp_path)
    try:
        assert cluster_mod.up(cfg) > 0
        assert cluster_mod.up(cfg) == 0.0, "a healthy cluster is reused"
        api = cluster_mod.api_client(cfg)
        kube = Cluster(cfg, api, cfg.kubeconfig)
        kube.core.create_namespaced_pod("default", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
            "spec": {"containers": [{"name": "main", "image": "kubeinfer/kubeinfer:e2e",
                                     "command": ["sleep", "600"]}]}})
        wait_for(lambda: any(n.startswith("pod-") for n in processes.running(cfg.state_dir)),
                 "the runner to start the sleeper process", timeout=30)
        api.close()
        pids = processes.running(cfg.state_dir)
    finally:
        stopped = cluster_mod.down(cfg)
    assert set(pids.values()) <= set(stopped)
    assert not [pid for pid in pids.values() if processes.pid_alive(pid)]
    assert not cfg.state_dir.exists()
