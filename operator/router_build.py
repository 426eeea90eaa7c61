"""What an InferenceService owns for its gateway — the router in front of its engines (pure).

It exists when `spec.routing.strategy` is not `none` (the cache-aware router) or at
`autoscaling.minReplicas: 0` (requests at zero replicas are held while one starts). A
Deployment running `kubeinfer gateway` (2 pods by default when the service may run 2 or more
engines, with a PodDisruptionBudget from 2), and the identity it acts with: a ServiceAccount
and a Role limited to this one InferenceService (read it, patch its scale subresource) plus
listing and watching pods to find Ready engines. The InferenceService's Service selects the
gateway pods instead of the engines (`service_selector`).
"""

from __future__ import annotations

from typing import Any

from kubeinfer.server.flags import to_args
from kubeinfer.server.kube.api import gateway_selector_labels
from kubeinfer.server.router.flags import PROCESS_FLAGS, ROUTING_FLAGS
from . import api
from .build import shared_env, tenancy_annotations, tenancy_env, tenancy_volumes, tenants_file
from .resource import InferenceService, OperatorConfig
from .security import restricted_container, restricted_pod

GATEWAY_PORT = 8080
COMPONENT = "app.kubernetes.io/component"


def needs_gateway(isvc: InferenceService) -> bool:
    """A routing strategy, or `minReplicas: 0` whoever scales (the built-in autoscaler, or
    KEDA/HPA/kubectl with `enabled: false`): a request at zero replicas must be held and wake a
    pod either way."""
    return isvc.spec.routing.strategy != "none" or isvc.spec.autoscaling.min_replicas == 0


def scales_from_zero(isvc: InferenceService) -> bool:
    """The gateway holds requests at zero replicas and wakes one (a router without
    `minReplicas: 0` leaves a service scaled to zero by hand alone)."""
    return isvc.spec.autoscaling.min_replicas == 0


def gateway_strategy(isvc: InferenceService) -> str:
    """`none` still holds requests at zero replicas: least-load, as the gateway always did."""
    strategy = isvc.spec.routing.strategy
    return "least-load" if strategy == "none" else strategy


def gateway_replicas(isvc: InferenceService) -> int:
    """`spec.routing.replicas`, else 2 when the service may run 2 or more engines (one router
    going away must not stop the service), else 1."""
    if isvc.spec.routing.replicas is not None:
        return max(1, isvc.spec.routing.replicas)
    scaling = isvc.spec.autoscaling
    most = scaling.max_replicas if scaling.enabled else isvc.spec.replicas
    return 2 if max(most, isvc.spec.replicas) >= 2 else 1


def gateway_pdb(isvc: InferenceService) -> dict[str, Any]:
    """At most one router evicted at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {**isvc.metadata(gateway_name(isvc)),
                         "labels": {**isvc.labels, COMPONENT: "gateway"}},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": gateway_selector_labels(isvc.name)}}}


def gateway_name(isvc: InferenceService) -> str:
    return f"{isvc.name}-gateway"


def service_selector(isvc: InferenceService) -> dict[str, str]:
    """Pods behind the InferenceService's Service: the gateway whenever there is one."""
    return gateway_selector_labels(isvc.name) if needs_gateway(isvc) else isvc.selector_labels


def gateway_children(isvc: InferenceService, config: OperatorConfig) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding and Deployment (and a PodDisruptionBudget from 2
    replicas), each owned by the InferenceService."""
    name = gateway_name(isvc)
    meta = {**isvc.metadata(name), "labels": {**isvc.labels, COMPONENT: "gateway"}}
    rules = [
        {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "resourceNames": [isvc.name],
         "verbs": ["get"]},
        {"apiGroups": [api.GROUP], "resources": [f"{api.PLURAL}/scale"],
         "resourceNames": [isvc.name], "verbs": ["get", "patch"]},
        # find Ready engines. No write to pods: a Role cannot be limited to one service's pods
        # (RBAC selects by name, not label), so the operator writes their deletion costs.
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    ]
    pdb = [gateway_pdb(isvc)] if gateway_replicas(isvc) >= 2 else []
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}]},
        gateway_deployment(isvc, config, meta),
        *pdb,
    ]


def routing_args(isvc: InferenceService) -> list[str]:
    """`spec.routing` as the router's flags, its queue's included (those left at their default
    are omitted)."""
    routing = isvc.spec.routing
    values = {"strategy": gateway_strategy(isvc), "load_penalty_tokens": routing.load_penalty_tokens,
              "balance_factor": routing.balance_factor, "balance_slack": routing.balance_slack,
              "kv_usage_limit": routing.kv_usage_limit, "prefix_key_tokens": routing.prefix_key_tokens,
              "warmup_prefixes": routing.warmup_prefixes, "warmup_tokens": routing.warmup_tokens,
              "warmup_hold_seconds": routing.warmup_hold_seconds}
    queue = {"max_in_flight_per_replica": routing.max_in_flight_per_replica,
             "max_queued_requests": routing.max_queued_requests}
    return to_args(values, ROUTING_FLAGS) + to_args(queue, PROCESS_FLAGS)


def router_tenancy_env(isvc: InferenceService, replicas: int) -> list[dict[str, Any]]:
    """What a router needs of the engines' settings and `spec.tenancy` (the HTTP gateway and the
    endpoint picker alike): the engines' API keys, body limit and block-hash secret, the tenant
    file and header trust, and, with a tenant table (a Secret's or inline), each of its
    `replicas` enforcing its share of the quotas."""
    env = [{"name": name, **source} for name, source in shared_env(isvc) + tenancy_env(isvc)]
    if tenants_file(isvc) is not None:
        quota_replicas = next(f.env for f in PROCESS_FLAGS if f.dest == "quota_replicas")
        env.append({"name": quota_replicas, "value": str(max(1, replicas))})
    return env


def tenancy_pod_parts(isvc: InferenceService) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod annotations, volumes, container mounts) that carry the tenant file to a router pod."""
    volumes, mounts = tenancy_volumes(isvc)
    return tenancy_annotations(isvc), volumes, mounts


def gateway_deployment(isvc: InferenceService, config: OperatorConfig,
                       meta: dict[str, Any]) -> dict[str, Any]:
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5}
    container = {
        "name": "gateway", "image": isvc.spec.engine.image or config.engine_image,
        "command": ["kubeinfer"],
        "args": ["gateway", "--inferenceservice", isvc.name, "--port", str(GATEWAY_PORT),
                 "--activation-timeout", str(isvc.spec.autoscaling.activation_timeout_seconds),
                 "--engine-admin-port", str(api.ADMIN_PORT), *routing_args(isvc)],
        # The gateway checks the engines' API keys and body limit itself, so an unauthenticated
        # or oversized request never wakes a service at zero; it hashes prompts with the
        # engines' secret. The kubelet reads the Secrets, the Role needs no access to them.
        "env": [{"name": "POD_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                *router_tenancy_env(isvc, gateway_replicas(isvc))],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",  # crash reasons reach status
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}},
        "readinessProbe": probe, "livenessProbe": {**probe, "periodSeconds": 10},
        "securityContext": restricted_container(),
    }
    tenant_annotations, tenant_volumes, tenant_mounts = tenancy_pod_parts(isvc)
    if tenant_mounts:
        container["volumeMounts"] = tenant_mounts
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(GATEWAY_PORT),
                   "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": gateway_replicas(isvc),
            "selector": {"matchLabels": gateway_selector_labels(isvc.name)},
            "template": {
                "metadata": {"labels": meta["labels"], "annotations": {**annotations, **tenant_annotations}},
                "spec": {"serviceAccountName": meta["name"], "enableServiceLinks": False,
                         "securityContext": restricted_pod(), "containers": [container],
                         **({"volumes": tenant_volumes} if tenant_volumes else {}),
                         # held requests finish or get their 503 before the pod goes away
                         "terminationGracePeriodSeconds":
                             isvc.spec.autoscaling.activation_timeout_seconds + 10},
            },
        },
    }
