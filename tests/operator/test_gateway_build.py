"""The gateway's Kubernetes objects, built from an InferenceService without a cluster."""

from __future__ import annotations

import argparse
from typing import Any

from kubeinfer.operator import api
from kubeinfer.operator.gateway import cli
from kubeinfer.operator.gateway.build import (gateway_children, needs_gateway,
                                              service_selector)
from kubeinfer.operator.resource import InferenceService, OperatorConfig

CONFIG = OperatorConfig(engine_image="kubeinfer/kubeinfer:test")


def isvc(**autoscaling: Any) -> InferenceService:
    return InferenceService.from_body({
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 3},
        "spec": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3,
                                 "activationTimeoutSeconds": 45, **autoscaling}}})


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


def test_only_scale_to_zero_services_route_through_a_gateway() -> None:
    assert needs_gateway(isvc())
    assert not needs_gateway(isvc(minReplicas=1))
    assert needs_gateway(isvc(enabled=False))  # KEDA/HPA scale it to zero: still held
    assert service_selector(isvc()) == {api.INSTANCE_LABEL: "chat",
                                        "app.kubernetes.io/component": "gateway"}
    assert service_selector(isvc(minReplicas=1)) == isvc().selector_labels


def test_children_are_owned_and_the_role_is_scoped_to_this_service() -> None:
    objects = by_kind(gateway_children(isvc(), CONFIG))
    assert set(objects) == {"ServiceAccount", "Role", "RoleBinding", "Deployment"}
    for obj in objects.values():
        assert obj["metadata"]["name"] == "chat-gateway"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    rules = {tuple(r["resources"]): r for r in objects["Role"]["rules"]}
    assert rules[("inferenceservices/scale",)] == {
        "apiGroups": ["kubeinfer.io"], "resources": ["inferenceservices/scale"],
        "resourceNames": ["chat"], "verbs": ["get", "patch"]}
    assert rules[("inferenceservices",)]["verbs"] == ["get"]
    assert rules[("pods",)]["verbs"] == ["list"]
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
