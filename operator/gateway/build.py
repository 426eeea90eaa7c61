"""What an InferenceService with `autoscaling.minReplicas: 0` owns for its gateway (pure).

A Deployment running `kubeinfer gateway`, and the identity it acts with: a ServiceAccount
and a Role limited to this one InferenceService (read it, patch its scale subresource) plus
listing pods to find Ready engines. The InferenceService's Service selects the gateway pods
instead of the engines (`service_selector`), so its URL keeps answering at zero replicas.
"""

from __future__ import annotations

from typing import Any

from kubeinfer.operator import api
from kubeinfer.operator.build import auth_env
from kubeinfer.operator.resource import InferenceService, OperatorConfig
from kubeinfer.operator.security import restricted_container, restricted_pod

GATEWAY_PORT = 8080
COMPONENT = "app.kubernetes.io/component"


def needs_gateway(isvc: InferenceService) -> bool:
    """`minReplicas: 0`, whoever scales: the built-in autoscaler, or KEDA/HPA/kubectl with
    `enabled: false` — a request at zero replicas must be held and wake a pod either way."""
    return isvc.spec.autoscaling.min_replicas == 0


def gateway_name(isvc: InferenceService) -> str:
    return f"{isvc.name}-gateway"


def gateway_selector_labels(name: str) -> dict[str, str]:
    """The gateway pods of InferenceService `name` (never matches its engines' selector)."""
    return {api.INSTANCE_LABEL: name, COMPONENT: "gateway"}


def service_selector(isvc: InferenceService) -> dict[str, str]:
    """Pods behind the InferenceService's Service: the gateway when it can scale to zero."""
    return gateway_selector_labels(isvc.name) if needs_gateway(isvc) else isvc.selector_labels


def gateway_children(isvc: InferenceService, config: OperatorConfig) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding and Deployment, each owned by the InferenceService."""
    name = gateway_name(isvc)
    meta = {**isvc.metadata(name), "labels": {**isvc.labels, COMPONENT: "gateway"}}
    rules = [
        {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "resourceNames": [isvc.name],
         "verbs": ["get"]},
        {"apiGroups": [api.GROUP], "resources": [f"{api.PLURAL}/scale"],
         "resourceNames": [isvc.name], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}]},
        gateway_deployment(isvc, config, meta),
    ]


def gateway_deployment(isvc: InferenceService, config: OperatorConfig,
                       meta: dict[str, Any]) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5}
    container = {
        "name": "gateway", "image": isvc.spec.engine.image or config.engine_image,
        "command": ["kubeinfer"],
        "args": ["gateway", "--inferenceservice", isvc.name, "--port", str(GATEWAY_PORT),
                 "--activation-timeout", str(isvc.spec.autoscaling.activation_timeout_seconds)],
        # The gateway checks the engines' API keys itself, so an unauthenticated request never
        # wakes a service at zero; the kubelet reads the Secret, the Role needs no access to it.
        "env": [{"name": "POD_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                *({"name": name, **source} for name, source in auth_env(isvc))],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}},
        "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 10},
        "securityContext": restricted_container(),
    }
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(GATEWAY_PORT),
                   "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": 1, "selector": {"matchLabels": gateway_selector_labels(isvc.name)},
            "template": {
                "metadata": {"labels": meta["labels"], "annotations": annotations},
                "spec": {"serviceAccountName": meta["name"], "enableServiceLinks": False,
                         "securityContext": restricted_pod(), "containers": [container],
                         # held requests finish or get their 503 before the pod goes away
                         "terminationGracePeriodSeconds":
                             isvc.spec.autoscaling.activation_timeout_seconds + 10},
            },
        },
    }
