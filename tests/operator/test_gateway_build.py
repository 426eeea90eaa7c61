"""The gateway's Kubernetes objects, built from an InferenceService without a cluster."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kubeinfer.operator import api
from kubeinfer.server.router import cli
from kubeinfer.operator.router_build import (gateway_children, needs_gateway,
                                             service_selector)
from kubeinfer.operator.resource import InferenceService, OperatorConfig

pytestmark = pytest.mark.unit

CONFIG = OperatorConfig(engine_image="kubeinfer/kubeinfer:test")


def isvc(routing: dict[str, Any] | None = None, **autoscaling: Any) -> InferenceService:
    return InferenceService.from_body({
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 3},
        "spec": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3,
                                 "activationTimeoutSeconds": 45, **autoscaling},
                 "routing": routing or {}}})


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


def test_routed_or_scale_to_zero_services_go_through_a_gateway() -> None:
    assert needs_gateway(isvc())
    assert needs_gateway(isvc(minReplicas=1))   # the router (prefix-aware by default)
    assert not needs_gateway(isvc(minReplicas=1, routing={"strategy": "none"}))
    assert needs_gateway(isvc(routing={"strategy": "none"}))   # at minReplicas 0 requests are still held
    assert needs_gateway(isvc(enabled=False))  # KEDA/HPA scale it to zero: still held
    assert service_selector(isvc()) == {api.INSTANCE_LABEL: "chat",
                                        "app.kubernetes.io/component": "gateway"}
    assert service_selector(isvc(minReplicas=1, routing={"strategy": "none"})) == isvc().selector_labels


def test_children_are_owned_and_the_role_is_scoped_to_this_service() -> None:
    objects = by_kind(gateway_children(isvc(), CONFIG))
    assert set(objects) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget"}
    for obj in objects.values():
        assert obj["metadata"]["name"] == "chat-gateway"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    # the whole Role: its own InferenceService and scale by name; pods read-only (a Role cannot
    # be limited to one service's pods, so the operator writes their deletion costs)
    assert objects["Role"]["rules"] == [
        {"apiGroups": ["kubeinfer.io"], "resources": ["inferenceservices"], "resourceNames": ["chat"],
         "verbs": ["get"]},
        {"apiGroups": ["kubeinfer.io"], "resources": ["inferenceservices/scale"], "resourceNames": ["chat"],
         "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert objects["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "chat-gateway", "namespace": "team-a"}]


def test_deployment_runs_the_gateway_cli_with_the_activation_timeout() -> None:
    deployment = by_kind(gateway_children(isvc(), CONFIG))["Deployment"]
    template = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    assert not isvc().selector_labels.items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    assert pod["serviceAccountName"] == "chat-gateway"
    container = pod["containers"][0]
    assert container["image"] == "kubeinfer/kubeinfer:test"
    assert container["ports"][0]["name"] == "http"  # the Service's targetPort
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    command = container["command"] + container["args"]
    assert command[:2] == ["kubeinfer", "gateway"]
    args = parser.parse_args(command[2:])
    assert (args.inferenceservice, args.port, args.activation_timeout) == ("chat", 8080, 45.0)
    assert pod["terminationGracePeriodSeconds"] > args.activation_timeout


def test_router_replicas_follow_the_engines_and_get_a_pdb_from_two() -> None:
    from kubeinfer.operator.children import stale_children
    from kubeinfer.operator.router_build import gateway_replicas

    def service(spec: dict[str, Any]) -> InferenceService:
        return InferenceService.from_body({"metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
                                           "spec": spec})

    assert gateway_replicas(service({"replicas": 1})) == 1
    assert gateway_replicas(service({"replicas": 3})) == 2
    assert gateway_replicas(service({"replicas": 1, "autoscaling": {"enabled": True, "maxReplicas": 4}})) == 2
    assert gateway_replicas(service({"replicas": 3, "routing": {"replicas": 5}})) == 5
    one = service({"replicas": 1})
    assert "PodDisruptionBudget" not in by_kind(gateway_children(one, CONFIG))
    assert ("PodDisruptionBudget", "chat-gateway") in stale_children(one)
    pdb = by_kind(gateway_children(service({"replicas": 3}), CONFIG))["PodDisruptionBudget"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        api.INSTANCE_LABEL: "chat", "app.kubernetes.io/component": "gateway"}}}


def test_spec_routing_reaches_the_router_as_its_flags() -> None:
    routed = isvc(routing={"strategy": "round-robin", "loadPenaltyTokens": 64, "balanceFactor": 0.5,
                           "prefixKeyTokens": 128})
    container = by_kind(gateway_children(routed, CONFIG))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert (args.strategy, args.load_penalty_tokens, args.balance_factor, args.prefix_key_tokens) == (
        "round-robin", 64.0, 0.5, 128)
    assert args.kv_usage_limit == 0.95   # defaults are not spelled out
    default = by_kind(gateway_children(isvc(), CONFIG))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert parser.parse_args(default["args"][1:]).strategy == "prefix-aware"
    # strategy none at minReplicas 0: the gateway only holds requests, least-loaded as before
    holding = by_kind(gateway_children(isvc(routing={"strategy": "none"}), CONFIG))["Deployment"]
    assert parser.parse_args(holding["spec"]["template"]["spec"]["containers"][0]["args"][1:]).strategy == "least-load"
