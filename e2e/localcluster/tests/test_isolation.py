"""`make test` keeps off the user's cluster: its own cluster by default, and a refusal instead of
upgrading a Helm release the tests did not install."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

import pytest

from e2e.localcluster.config import TEST_CLUSTER_ENV, ClusterConfig, use_test_cluster
from e2e.helpers import TEST_RELEASE_DESCRIPTION, foreign_release

pytestmark = pytest.mark.integration


def config_under(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> ClusterConfig:
    for name in TEST_CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return ClusterConfig()


def test_tests_default_to_a_cluster_apart_from_the_demos(monkeypatch: pytest.MonkeyPatch) -> None:
    demo = config_under(monkeypatch, {})
    environ: dict[str, str] = {}
    assert use_test_cluster(environ) and environ == TEST_CLUSTER_ENV
    tests = config_under(monkeypatch, environ)
    assert tests.state_dir != demo.state_dir and tests.pod_cidr != demo.pod_cidr
    assert not set(tests.ports.values()) & set(demo.ports.values())
    assert not set(tests.service_ports) & set(demo.service_ports)


def test_a_chosen_cluster_is_left_as_chosen() -> None:
    environ = {"KUBEINFER_CLUSTER_DIR": "/somewhere"}
    assert not use_test_cluster(environ) and environ == {"KUBEINFER_CLUSTER_DIR": "/somewhere"}


@dataclass
class FakeHelm:
    history: list[dict] | None

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        assert args[:2] == ("history", "kubeinfer")
        if self.history is None:
            return subprocess.CompletedProcess(args, 1, "", "Error: release: not found")
        return subprocess.CompletedProcess(args, 0, json.dumps(self.history), "")


def test_only_the_tests_own_release_or_none_is_theirs_to_change() -> None:
    assert foreign_release(FakeHelm(None)) == ""
    assert foreign_release(FakeHelm([{"revision": 4, "description": TEST_RELEASE_DESCRIPTION}])) == ""
    why = foreign_release(FakeHelm([{"revision": 2, "description": "Upgrade complete"}]))
    assert "revision 2 was not installed by the tests ('Upgrade complete')" in why

