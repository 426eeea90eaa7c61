"""`kubeinfer operator`: its flags and the kopf peering objects it makes sure exist."""

from __future__ import annotations

import argparse

import pytest
from fake_apiserver import Recorder, kube  # noqa: F401  (kube is a fixture)

from kubeinfer.server.kube.client import Kube
from kubeinfer.operator.main import add_arguments, ensure_peering

pytestmark = pytest.mark.unit


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_scope_flags() -> None:
    assert parse("-n", "a", "-n", "b").namespace == ["a", "b"]
    assert parse().namespace == [] and not parse().standalone
    with pytest.raises(SystemExit):
        parse("--namespace", "a", "--all-namespaces")


def test_cluster_wide_peering_is_created_once(kube: Kube) -> None:  # noqa: F811
    Recorder.answers["/apis/kopf.dev/v1/clusterkopfpeerings"] = (409, {"reason": "AlreadyExists"})
    ensure_peering(kube, "kubeinfer", [])
    sent = Recorder.seen[-1]
    assert (sent["method"], sent["body"]["kind"]) == ("POST", "ClusterKopfPeering")


def test_namespaced_peering_per_namespace(kube: Kube) -> None:  # noqa: F811
    ensure_peering(kube, "kubeinfer", ["team-a", "team-b"])
    assert [s["path"] for s in Recorder.seen] == [
        "/apis/kopf.dev/v1/namespaces/team-a/kopfpeerings",
        "/apis/kopf.dev/v1/namespaces/team-b/kopfpeerings"]


def test_missing_peering_crd_explains_the_fix(kube: Kube) -> None:  # noqa: F811
    Recorder.answers["/apis/kopf.dev/v1/clusterkopfpeerings"] = (404, {"reason": "NotFound"})
    with pytest.raises(SystemExit, match="--standalone"):
        ensure_peering(kube, "kubeinfer", [])
