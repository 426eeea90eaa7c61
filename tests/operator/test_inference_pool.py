"""spec.inferencePool renders a Gateway API Inference Extension InferencePool of the engines and
kubeinfer's endpoint picker for it, beside the router; turning it off removes them. Without GIE's
InferencePool CRD the rest is applied and a condition says what to install."""

from __future__ import annotations

import pytest
from isvc_builders import CONFIG, body, by_key, make_isvc, matches
from test_reconcile import MemoryKube, conditions

from kubeinfer.operator import api
from kubeinfer.operator.children import desired_children, stale_children
from kubeinfer.operator.inference_pool import POOL_CRD
from kubeinfer.operator.reconcile import Reconciler
from kubeinfer.server.kube.client import COLLECTIONS

pytestmark = pytest.mark.unit
POOL = {"replicas": 3, "inferencePool": {"enabled": True, "failureMode": "FailOpen", "fallbackEndpoints": 1}}


def test_the_pool_selects_the_engines_and_names_the_picker() -> None:
    children = by_key(desired_children(make_isvc(POOL), CONFIG))
    pool = children[("InferencePool", "chat")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    engines = children[("Deployment", "chat")]["spec"]["template"]["metadata"]["labels"]
    picker_pod = children[("Deployment", "chat-epp")]["spec"]["template"]["metadata"]["labels"]
    assert matches(pool["spec"]["selector"]["matchLabels"], engines)
    assert not matches(pool["spec"]["selector"]["matchLabels"], picker_pod)   # the picker is no endpoint
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "chat-epp", "kind": "Service", "port": {"number": 9002},
                                                 "failureMode": "FailOpen"}
    service = children[("Service", "chat-epp")]["spec"]
    assert matches(service["selector"], picker_pod) and service["ports"][0]["port"] == 9002
    assert service["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    assert ("Deployment", "chat-gateway") in children   # the router stays beside the pool
    assert children[("Service", "chat")]["spec"]["selector"] != service["selector"]
    kinds = [(c["kind"], c["metadata"]["name"]) for c in desired_children(make_isvc(POOL), CONFIG)]
    assert kinds.index(("Service", "chat-epp")) < kinds.index(("InferencePool", "chat"))


def test_the_picker_runs_kubeinfer_route_as_an_ext_proc_server_with_least_privilege() -> None:
    children = by_key(desired_children(make_isvc({**POOL, "routing": {"strategy": "least-load"}}), CONFIG))
    container = children[("Deployment", "chat-epp")]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[:6] == ["route", "--inferenceservice", "chat", "--no-http", "--ext-proc-port", "9002"]
    assert args[args.index("--fallback-endpoints") + 1] == "1"
    assert args[args.index("--strategy") + 1] == "least-load"
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    rules = children[("Role", "chat-epp")]["rules"]
    assert {v for rule in rules for v in rule["verbs"]} == {"get", "list", "watch"}
    assert next(r for r in rules if r["resources"] == ["inferenceservices"])["resourceNames"] == ["chat"]
    binding = children[("RoleBinding", "chat-epp")]
    assert binding["subjects"][0]["name"] == children[("Deployment", "chat-epp")]["spec"]["template"]["spec"][
        "serviceAccountName"] == "chat-epp"


def test_the_picker_serves_its_metrics_for_prometheus_but_not_on_its_service() -> None:
    children = by_key(desired_children(make_isvc(POOL), CONFIG))
    template = children[("Deployment", "chat-epp")]["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert container["args"][container["args"].index("--metrics-port") + 1] == "9090"
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    annotations = template["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", "9090")
    assert [p["port"] for p in children[("Service", "chat-epp")]["spec"]["ports"]] == [9002]


def test_multi_pod_replicas_put_only_leaders_in_the_pool() -> None:
    isvc = make_isvc({**POOL, "engine": {"tensorParallelSize": 2, "podsPerReplica": 2}})
    children = by_key(desired_children(isvc, CONFIG, lws_installed=True))
    selector = children[("InferencePool", "chat")]["spec"]["selector"]["matchLabels"]
    template = children[("LeaderWorkerSet", "chat")]["spec"]["leaderWorkerTemplate"]
    assert matches(selector, template["leaderTemplate"]["metadata"]["labels"])
    assert not matches(selector, template["workerTemplate"]["metadata"]["labels"])


def test_off_by_default_and_removed_when_turned_off() -> None:
    children = by_key(desired_children(make_isvc({"replicas": 2}), CONFIG))
    assert not any(kind == "InferencePool" or name == "chat-epp" for kind, name in children)
    stale = stale_children(make_isvc({"replicas": 2}))
    assert ("InferencePool", "chat") in stale and ("Deployment", "chat-epp") in stale
    assert not any(name == "chat-epp" or kind == "InferencePool" for kind, name in stale_children(make_isvc(POOL)))
    assert all(kind in COLLECTIONS for kind, _ in stale)


def test_without_gie_crds_the_rest_is_applied_and_a_condition_says_what_to_install() -> None:
    kube = MemoryKube()   # no CustomResourceDefinition inferencepools.inference.networking.k8s.io
    Reconciler(kube, CONFIG).reconcile(body(POOL), trigger="create")  # type: ignore[arg-type]
    assert ("InferencePool", "chat") not in kube.objects
    assert {("Deployment", "chat"), ("Service", "chat"), ("Deployment", "chat-epp"), ("Service", "chat-epp")} \
        <= set(kube.objects)
    status = kube.statuses[-1]
    assert conditions(status)["Degraded"] == "True/InferencePoolCRDMissing"
    assert conditions(status)["Ready"] != "False/InferencePoolCRDMissing"   # the engines serve regardless
    message = next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    assert POOL_CRD in message and api.GIE_INSTALL in message

    kube.objects[("CustomResourceDefinition", POOL_CRD)] = {"metadata": {"name": POOL_CRD}}
    Reconciler(kube, CONFIG).reconcile(body(POOL), trigger="update")  # type: ignore[arg-type]
    assert ("InferencePool", "chat") in kube.objects
    assert conditions(kube.statuses[-1])["Degraded"] != "True/InferencePoolCRDMissing"
