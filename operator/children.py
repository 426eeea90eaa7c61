"""Everything an InferenceService owns: Deployment (or LeaderWorkerSet for multi-pod replicas),
ClusterIP Service, PodDisruptionBudget, the gateway — the router, also holding requests at zero
replicas (operator/router_build.py) — and, with `kubeinfer operator --network-policy`, a
NetworkPolicy in front of its engines.

`desired_children` is the whole answer to "what should exist"; `stale_children` names what
must go (the PDB once replicas drop to 1 or less, where it would block node drains; the
gateway with `routing.strategy: none` once the service can no longer scale to zero, and its
PodDisruptionBudget below 2 router replicas; the engines' Deployment once replicas span pods,
their LeaderWorkerSet once they no longer do).
"""

from __future__ import annotations

from typing import Any

from kubeinfer.server.kube.api import gateway_selector_labels
from . import api
from .build import workload
from .inference_pool import PICKER_KINDS, POOL_KIND, picker_name, pool_children
from .router_build import (gateway_children, gateway_name, gateway_replicas,
                          needs_gateway, service_selector)
from .resource import InferenceService, NetworkPolicyConfig, OperatorConfig

GATEWAY_KINDS = ("PodDisruptionBudget", "Deployment", "RoleBinding", "Role", "ServiceAccount")  # deletion order


def service(isvc: InferenceService) -> dict[str, Any]:
    """ClusterIP Service on port 80 in front of the engines' (or the gateway's) http port."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": isvc.metadata(),
        "spec": {"type": "ClusterIP", "selector": service_selector(isvc),
                 "ports": [{"name": "http", "port": api.SERVICE_PORT, "targetPort": "http",
                            "protocol": "TCP", "appProtocol": "http"}]},
    }


def pod_disruption_budget(isvc: InferenceService) -> dict[str, Any]:
    """At most one engine evicted at a time, so a drain never takes the whole model down."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": isvc.metadata(),
        "spec": {"maxUnavailable": 1, "selector": engine_pods_selector(isvc)},
    }


def engine_pods_selector(isvc: InferenceService) -> dict[str, Any]:
    """Every engine pod: with multi-pod replicas leaders and workers alike, so a drain evicts one
    pod at a time and breaks at most one group at a time."""
    if not isvc.spec.multi_pod:
        return {"matchLabels": isvc.selector_labels}
    return {"matchLabels": {api.INSTANCE_LABEL: isvc.name},
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                  "values": [isvc.selector_labels["app.kubernetes.io/component"],
                                             api.WORKER_COMPONENT]}]}


def network_policy(isvc: InferenceService, policy: NetworkPolicyConfig) -> dict[str, Any]:
    """Ingress to the engine pods: from its own engines (multi-node ranks), its routers, the
    operator (adapters, metrics) and the admin's extra peers, on every port; from anyone else
    only to the API port, and only when no router fronts the engines (the Service selects them)."""
    operator_pods = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": policy.operator_namespace}},
                     "podSelector": {"matchLabels": dict(policy.operator_labels)}}
    trusted = [{"podSelector": engine_pods_selector(isvc)},
               {"podSelector": {"matchLabels": gateway_selector_labels(isvc.name)}},
               operator_pods, *policy.allow_from]
    ingress: list[dict[str, Any]] = [{"from": trusted}]
    if not needs_gateway(isvc):
        ingress.append({"ports": [{"port": "http", "protocol": "TCP"}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": isvc.metadata(),
            "spec": {"podSelector": engine_pods_selector(isvc), "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def desired_children(isvc: InferenceService, config: OperatorConfig, lws_installed: bool = True,
                     pool_installed: bool = True) -> list[dict[str, Any]]:
    """In apply order: the gateway exists before the Service is pointed at it. Multi-pod
    replicas without the LeaderWorkerSet CRD get no engines, and `spec.inferencePool` without
    GIE's InferencePool CRD gets its picker but no pool (a condition says why for both)."""
    children = [] if isvc.spec.multi_pod and not lws_installed else [workload(isvc, config)]
    if config.network_policy is not None:
        children.append(network_policy(isvc, config.network_policy))
    if needs_gateway(isvc):
        children += gateway_children(isvc, config)
    if isvc.spec.inference_pool.enabled:
        children += [c for c in pool_children(isvc, config) if pool_installed or c["kind"] != POOL_KIND]
    children.append(service(isvc))
    if isvc.spec.replicas > 1:
        children.append(pod_disruption_budget(isvc))
    return children


def stale_children(isvc: InferenceService, lws_installed: bool = False) -> list[tuple[str, str]]:
    """(kind, name) of children that must not exist for this spec (a LeaderWorkerSet is only
    looked for where its CRD exists)."""
    stale = [] if isvc.spec.replicas > 1 else [("PodDisruptionBudget", isvc.name)]
    if isvc.spec.multi_pod:
        stale.append(("Deployment", isvc.name))
    elif lws_installed:
        stale.append((api.LWS_KIND, isvc.name))
    if not needs_gateway(isvc):
        stale += [(kind, gateway_name(isvc)) for kind in GATEWAY_KINDS]
    elif gateway_replicas(isvc) < 2:
        stale.append(("PodDisruptionBudget", gateway_name(isvc)))
    if not isvc.spec.inference_pool.enabled:   # a 404 (no such object, or no GIE CRD) is fine
        stale += [(POOL_KIND, isvc.name)] + [(kind, picker_name(isvc)) for kind in PICKER_KINDS]
    return stale
