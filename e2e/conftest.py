"""pytest fixtures for end-to-end tests on the local cluster (see e2e/localcluster/cluster.py).

Stable API for every e2e test (operator, autoscaler, ...); mark each module with its tier,
``pytestmark = pytest.mark.e2e`` (e2e/tiers.py):

- ``cluster`` (session): an ``e2e.helpers.Cluster`` — ``.kubeconfig``, ``.api`` (kubernetes
  ApiClient), ``.core``/``.apps``, ``.kubectl(*args, stdin=...)``, ``.kubectl_json(...)``,
  ``.helm(*args)``, ``.pods(namespace, selector)``. Tests use their own cluster
  (``config.TEST_CLUSTER_ENV``: its own directory, ports and pod IPs), never the one ``make demo``
  and ``make cluster-up`` use, unless KUBEINFER_CLUSTER_* choose one. A healthy running cluster
  is reused and left running; otherwise the fixture builds/starts one, and the last test session
  using it stops every process at its end, also when tests fail or the run is interrupted
  (finalizer + atexit). Concurrent sessions share one cluster (up/down hold a file lock). On a
  cluster the tests did not start, a ``kubeinfer`` Helm release the tests did not install makes
  every e2e test fail with the reason instead of upgrading someone's release.
  With ``KUBEINFER_E2E_KUBECONFIG`` set, that cluster is used instead (``.local`` is False;
  see e2e/localcluster/kind/) and never torn down.
- ``local_cluster`` (function): the ``cluster``, skipping the test on an external one (for
  tests that need the local pod runner's processes and loopback pod IPs).
- ``namespace`` (function): a fresh namespace whose ``default`` ServiceAccount exists (pods are
  refused before that); deleted after the test.
- ``e2e.helpers.wait_for(fetch, what, timeout)`` and ``e2e.helpers.pod_ready(pod)``.

Nodes: ``ClusterConfig().gpu_nodes`` fake nodes ``kubeinfer-gpu-<i>`` with ``nvidia.com/gpu: 8``
and labels ``nvidia.com/gpu.product``, ``type=kwok``; no taints. Pods whose image starts with
``kubeinfer/`` run as local processes on their loopback pod IP (e2e/localcluster/podrunner.py); label a pod
``kubeinfer.io/simulate: "true"`` to leave it simulated.
"""
from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import config as kube_config

from e2e.localcluster import cluster as cluster_mod
from e2e.localcluster import processes
from e2e.localcluster.config import ClusterConfig, use_test_cluster
from e2e.helpers import Cluster, foreign_release, wait_for
from e2e.tiers import check_tiers

use_test_cluster()

STARTED_BY_PYTEST = "started-by-pytest"  # absent when a developer ran `make cluster-up`


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_tiers(items, Path(__file__).resolve().parent)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    external = os.environ.get("KUBEINFER_E2E_KUBECONFIG")
    if external:
        api = kube_config.new_client_from_config(config_file=external)
        yield Cluster(ClusterConfig(), api, Path(external), local=False)
        api.close()
        return
    cfg = ClusterConfig()
    with cluster_mod.locked(cfg):
        if not cluster_mod.healthy(cfg):
            atexit.register(_leave, cfg)  # registered first: also covers a failing `up`
            cluster_mod.up(cfg)
            (cfg.state_dir / STARTED_BY_PYTEST).touch()
        (cfg.state_dir / "sessions").mkdir(exist_ok=True)
        (cfg.state_dir / "sessions" / str(os.getpid())).touch()
    atexit.register(_leave, cfg)  # covers interrupts that skip fixture teardown
    api = cluster_mod.api_client(cfg)
    try:
        kube = Cluster(cfg, api, cfg.kubeconfig)
        if not (cfg.state_dir / STARTED_BY_PYTEST).exists() and (foreign := foreign_release(kube)):
            pytest.fail(f"refusing to run e2e tests on the cluster in {cfg.state_dir}: {foreign}. make test "
                        "never changes a release it did not install; unset KUBEINFER_CLUSTER_DIR/_PORT_BASE/"
                        "_POD_CIDR to let the tests use their own cluster", pytrace=False)
        yield kube
    finally:
        api.close()
        _leave(cfg)
        atexit.unregister(_leave)


def _leave(cfg: ClusterConfig) -> None:
    """The last test session using a cluster that a test session started stops it."""
    with cluster_mod.locked(cfg):
        (cfg.state_dir / "sessions" / str(os.getpid())).unlink(missing_ok=True)
        others = [s for s in (cfg.state_dir / "sessions").glob("*") if processes.pid_alive(int(s.name))]
        if not others and (cfg.state_dir / STARTED_BY_PYTEST).exists():
            cluster_mod.down(cfg)


@pytest.fixture
def local_cluster(cluster: Cluster) -> Cluster:
    if not cluster.local:
        pytest.skip("needs the local cluster's pod runner")
    return cluster


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"e2e-{request.node.name[:40].lower().replace('_', '-').strip('-')}-{uuid.uuid4().hex[:5]}"
    name = "".join(ch for ch in name if ch.isalnum() or ch == "-")
    cluster.core.create_namespace({"metadata": {"name": name, "labels": {"kubeinfer.io/e2e": "true"}}})
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in cluster.core.list_namespaced_service_account(name).items),
             f"ServiceAccount {name}/default", timeout=30)
    yield name
    cluster.core.delete_namespace(name)
