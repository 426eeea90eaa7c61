"""What an InferenceService owns for a Gateway API Inference Extension gateway (pure).

With `spec.inferencePool.enabled`: an `InferencePool` (inference.networking.k8s.io/v1) whose
selector is the engine pods' labels (only leaders carry them with multi-pod replicas) on the
engines' port, and kubeinfer's endpoint picker for it: `kubeinfer route --inferenceservice NAME
--no-http --ext-proc-port 9002` (the router's picker and `spec.routing` knobs) with its
ServiceAccount, a Role to read the InferenceService and watch its pods, and a Service the pool's
`endpointPickerRef` names (h2c). The router Service stays as it is, beside the pool. The picker
serves its metrics on 9090 (as GIE's EPP; scraped by annotation, not on the Service). It
gets what the router gets of the engines' settings and `spec.tenancy` (keys, block-hash secret,
tenant file; each picker replica enforcing its share of the quotas), so requests through the
gateway meet the same tenants and quotas as those through the router.
"""

from __future__ import annotations

from typing import Any

from . import api
from .resource import InferenceService, OperatorConfig
from .router_build import COMPONENT, router_tenancy_env, routing_args, tenancy_pod_parts
from .security import restricted_container, restricted_pod

POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"
POOL_CRD = "inferencepools.inference.networking.k8s.io"
EPP_PORT = 9002
METRICS_PORT = 9090   # GIE's EPP's; not on the picker's Service
PICKER_KINDS = ("Service", "Deployment", "RoleBinding", "Role", "ServiceAccount")   # deletion order


def picker_name(isvc: InferenceService) -> str:
    return f"{isvc.name}-epp"


def picker_labels(isvc: InferenceService) -> dict[str, str]:
    return {api.INSTANCE_LABEL: isvc.name, COMPONENT: "endpoint-picker"}


def inference_pool(isvc: InferenceService) -> dict[str, Any]:
    pool = isvc.spec.inference_pool
    return {"apiVersion": POOL_API_VERSION, "kind": POOL_KIND,
            "metadata": {**isvc.metadata(isvc.name), "labels": dict(isvc.labels)},
            "spec": {"selector": {"matchLabels": dict(isvc.selector_labels)},
                     "targetPorts": [{"number": api.HTTP_PORT}],
                     "endpointPickerRef": {"name": picker_name(isvc), "kind": "Service",
                                           "port": {"number": EPP_PORT}, "failureMode": pool.failure_mode}}}


def pool_children(isvc: InferenceService, config: OperatorConfig) -> list[dict[str, Any]]:
    """In apply order: the picker's identity, its Deployment and Service, then the pool."""
    name = picker_name(isvc)
    labels = {**isvc.labels, **picker_labels(isvc)}
    meta = {**isvc.metadata(name), "labels": labels}
    rules = [{"apiGroups": [api.GROUP], "resources": [api.PLURAL], "resourceNames": [isvc.name], "verbs": ["get"]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    probe = {"grpc": {"port": EPP_PORT, "service": "readiness"}, "periodSeconds": 5}
    container = {
        "name": "endpoint-picker", "image": isvc.spec.engine.image or config.engine_image,
        "command": ["kubeinfer"],
        "args": ["route", "--inferenceservice", isvc.name, "--no-http", "--ext-proc-port", str(EPP_PORT),
                 "--fallback-endpoints", str(isvc.spec.inference_pool.fallback_endpoints),
                 "--metrics-port", str(METRICS_PORT), *routing_args(isvc)],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                *router_tenancy_env(isvc, isvc.spec.inference_pool.replicas)],
        "ports": [{"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "readinessProbe": probe, "livenessProbe": {"grpc": {"port": EPP_PORT, "service": "liveness"},
                                                   "periodSeconds": 10},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": restricted_container(),
    }
    tenant_annotations, volumes, mounts = tenancy_pod_parts(isvc)
    if mounts:
        container["volumeMounts"] = mounts
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                   "prometheus.io/path": "/metrics", **tenant_annotations}
    selector = picker_labels(isvc)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
         "spec": {"replicas": isvc.spec.inference_pool.replicas, "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": labels, "annotations": annotations},
                               "spec": {"serviceAccountName": name, "enableServiceLinks": False,
                                        "securityContext": restricted_pod(), "containers": [container],
                                        **({"volumes": volumes} if volumes else {})}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"selector": selector, "ports": [{"name": "grpc", "port": EPP_PORT, "targetPort": "grpc",
                                                   "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]}},
        inference_pool(isvc),
    ]
