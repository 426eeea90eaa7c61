"""What an admin restricts with the chart: the images InferenceServices may run (refused with a
condition, nothing created) and a NetworkPolicy per InferenceService in front of its engines."""

from __future__ import annotations

import dataclasses

import pytest

from isvc_builders import CONFIG, body, make_isvc
from test_reconcile import MemoryKube, conditions

from kubeinfer.operator.children import desired_children, network_policy
from kubeinfer.operator.reconcile import Reconciler
from kubeinfer.operator.resource import NetworkPolicyConfig

pytestmark = pytest.mark.unit

ALLOWED = dataclasses.replace(CONFIG, allowed_images=("registry.example.com/kubeinfer/*", "kubeinfer/kubeinfer:test"))
POLICY = NetworkPolicyConfig(operator_namespace="kubeinfer-system",
                             allow_from=({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},))


def test_an_image_outside_the_allowed_list_is_refused_with_a_condition_and_nothing_created() -> None:
    kube = MemoryKube()
    reconciler = Reconciler(kube, ALLOWED)  # type: ignore[arg-type]
    events = reconciler.reconcile(body({"engine": {"image": "evil.example.com/miner:1"}}), trigger="create")
    assert kube.objects == {}
    degraded = next(c for c in kube.statuses[-1]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ImageNotAllowed")
    assert "evil.example.com/miner:1" in degraded["message"] and "registry.example.com/kubeinfer/*" in degraded["message"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "ImageNotAllowed")]
    for image in ("registry.example.com/kubeinfer/engine:0.1.0", None):   # a pattern; the default image
        kube = MemoryKube()
        spec = {"engine": {"image": image}} if image else {}
        Reconciler(kube, ALLOWED).reconcile(body(spec), trigger="create")  # type: ignore[arg-type]
        assert ("Deployment", "chat") in kube.objects and conditions(kube.statuses[-1])["Degraded"] == "False/AsExpected"


def test_no_allowed_list_allows_any_image() -> None:
    assert CONFIG.image_allowed("anything.example.com/x:y")


def test_the_network_policy_admits_routers_own_engines_operator_and_extra_peers_only() -> None:
    routed = network_policy(make_isvc({}), POLICY)   # the default: a router fronts the engines
    spec = routed["spec"]
    assert spec["podSelector"] == {"matchLabels": make_isvc({}).selector_labels} and spec["policyTypes"] == ["Ingress"]
    assert len(spec["ingress"]) == 1 and "ports" not in spec["ingress"][0]
    peers = spec["ingress"][0]["from"]
    assert peers == [
        {"podSelector": {"matchLabels": {"kubeinfer.io/inferenceservice": "chat", "app.kubernetes.io/component": "engine"}}},
        {"podSelector": {"matchLabels": {"kubeinfer.io/inferenceservice": "chat", "app.kubernetes.io/component": "gateway"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeinfer-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator", "app.kubernetes.io/name": "kubeinfer"}}},
        POLICY.allow_from[0]]
    direct = network_policy(make_isvc({"routing": {"strategy": "none"}}), POLICY)["spec"]["ingress"]
    assert direct[1] == {"ports": [{"port": "http", "protocol": "TCP"}]}   # the Service selects the engines: clients
    assert direct[0] == spec["ingress"][0]


def test_the_policy_is_a_child_only_when_asked_for() -> None:
    kinds = lambda config: [c["kind"] for c in desired_children(make_isvc({}), config)]  # noqa: E731
    assert "NetworkPolicy" not in kinds(CONFIG)
    assert "NetworkPolicy" in kinds(dataclasses.replace(CONFIG, network_policy=POLICY))
