"""The operator owns the scale-from-zero gateway: created at minReplicas 0, removed after.

Pure builders and the reconcile loop against the in-memory API of test_reconcile; the chart's
RBAC is rendered with helm to prove the operator may hand out the gateway's Role.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from isvc_builders import CONFIG, body, by_key, make_isvc, matches
from test_reconcile import MemoryKube

from e2e.localcluster.binaries import binary, ensure
from kubeinfer.operator.children import desired_children, stale_children
from kubeinfer.server.kube.client import COLLECTIONS
from kubeinfer.operator.reconcile import Reconciler

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "helm" / "kubeinfer"
TO_ZERO = {"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3}}
TO_ONE = {"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3},
          "routing": {"strategy": "none"}}   # without the router, only scale-to-zero needs a gateway
GATEWAY_KINDS = {"ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget"}


def test_scale_to_zero_adds_the_gateway_and_points_the_service_at_it() -> None:
    children = by_key(desired_children(make_isvc(TO_ZERO), CONFIG))
    assert {kind for kind, name in children if name == "chat-gateway"} == GATEWAY_KINDS
    gateway_pod = children[("Deployment", "chat-gateway")]["spec"]["template"]["metadata"]
    service = children[("Service", "chat")]["spec"]
    assert matches(service["selector"], gateway_pod["labels"])
    assert service["ports"][0]["targetPort"] == "http"  # the gateway container's port name
    kinds = [c["kind"] for c in desired_children(make_isvc(TO_ZERO), CONFIG)]
    assert kinds.index("Service") > kinds.index("Deployment", 1)  # gateway first, then route


def test_gateway_and_engine_pods_never_share_a_selector() -> None:
    children = by_key(desired_children(make_isvc(TO_ZERO), CONFIG))
    engine, gateway = children[("Deployment", "chat")], children[("Deployment", "chat-gateway")]
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert not matches(engine["spec"]["selector"]["matchLabels"], gateway_labels)
    assert not matches(gateway["spec"]["selector"]["matchLabels"], engine_labels)
    pdb = children[("PodDisruptionBudget", "chat")]["spec"]["selector"]["matchLabels"]
    assert matches(pdb, engine_labels) and not matches(pdb, gateway_labels)
    assert not matches(make_isvc(TO_ZERO).selector_labels, gateway_labels)  # status.selector


def test_without_scale_to_zero_the_service_selects_engines_and_the_gateway_is_stale() -> None:
    isvc = make_isvc(TO_ONE)
    children = by_key(desired_children(isvc, CONFIG))
    assert not [key for key in children if key[1] == "chat-gateway"]
    assert children[("Service", "chat")]["spec"]["selector"] == isvc.selector_labels
    assert {kind for kind, name in stale_children(isvc) if name == "chat-gateway"} == GATEWAY_KINDS
    assert not [s for s in stale_children(make_isvc(TO_ZERO)) if s[1] == "chat-gateway"]


def test_every_child_kind_has_a_rest_path() -> None:
    kinds = {c["kind"] for c in desired_children(make_isvc(TO_ZERO), CONFIG)}
    kinds |= {kind for kind, _ in stale_children(make_isvc(TO_ONE))}
    assert kinds <= set(COLLECTIONS)


def test_reconcile_removes_the_gateway_when_min_replicas_goes_from_zero_to_one() -> None:
    kube = MemoryKube()
    reconciler = Reconciler(kube, CONFIG)
    reconciler.reconcile(body(TO_ZERO), trigger="create")  # type: ignore[arg-type]
    assert {k for k, n in kube.objects if n == "chat-gateway"} == GATEWAY_KINDS
    assert kube.objects[("Service", "chat")]["spec"]["selector"][
        "app.kubernetes.io/component"] == "gateway"
    reconciler.reconcile(body(TO_ONE, generation=2), trigger="update")  # type: ignore[arg-type]
    assert not [key for key in kube.objects if key[1] == "chat-gateway"]
    assert kube.objects[("Service", "chat")]["spec"]["selector"][
        "app.kubernetes.io/component"] == "engine"
    assert ("Deployment", "chat") in kube.objects


@pytest.fixture(scope="module")
def operator_rules() -> dict[str, list[dict[str, Any]]]:
    """The operator's RBAC rules as the chart renders them, cluster-wide and per namespace."""
    ensure("helm")
    def render(*sets: str) -> list[dict[str, Any]]:
        flags = [arg for s in sets for arg in ("--set", s)]
        result = subprocess.run([str(binary("helm")), "template", "kubeinfer", str(CHART),
                                 "--namespace", "kubeinfer-system", "--kube-version", "1.33.0",
                                 *flags], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        return [d for d in docs if d["kind"] in ("ClusterRole", "Role")
                and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})]

    namespaced = render("watch.namespaces={team-a}")
    return {"cluster-wide": render()[0]["rules"],
            "namespaced": [rule for role in namespaced for rule in role["rules"]]}


def allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               and not r.get("resourceNames") for r in rules)


@pytest.mark.parametrize("install", ["cluster-wide", "namespaced"])
def test_the_gateway_role_is_a_subset_of_the_operators(
        operator_rules: dict[str, list[dict[str, Any]]], install: str) -> None:
    """Kubernetes refuses a Role granting more than its creator holds (without `escalate`)."""
    rules = operator_rules[install]
    role = by_key(desired_children(make_isvc(TO_ZERO), CONFIG))[("Role", "chat-gateway")]
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert allowed(rules, group, resource, verb), (group, resource, verb)
    assert not any(verb in r["verbs"] for r in rules for verb in ("escalate", "bind", "*"))


@pytest.mark.parametrize("install", ["cluster-wide", "namespaced"])
def test_the_operator_may_apply_and_delete_the_gateway_children(
        operator_rules: dict[str, list[dict[str, Any]]], install: str) -> None:
    groups = {"ServiceAccount": ("", "serviceaccounts"),
              "Role": ("rbac.authorization.k8s.io", "roles"),
              "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
              "Deployment": ("apps", "deployments")}
    for kind, (group, resource) in groups.items():
        for verb in ("get", "create", "patch", "delete"):  # server-side apply creates by PATCH
            assert allowed(operator_rules[install], group, resource, verb), (kind, verb)
