"""`helm lint` and `helm template` of helm/kubeinfer, with the helm the local cluster builds.

The binary comes from e2e.localcluster.binaries (pinned, cached under ~/.cache/kubeinfer/bin), so unit
tests and e2e use one helm; the first run builds it from the Go module proxy.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.localcluster.binaries import binary, ensure
from kubeinfer.operator import api
from kubeinfer.operator.inference_pool import POOL_CRD

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "helm" / "kubeinfer"
KUBE_VERSION = "1.33.0"  # the local cluster's minor; helm's built-in default is older


@pytest.fixture(scope="module")
def helm() -> str:
    ensure("helm")
    return str(binary("helm"))


def run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def render(helm: str, *sets: str) -> list[dict[str, Any]]:
    flags = [arg for s in sets for arg in ("--set", s)]
    result = run(helm, "template", "kubeinfer", str(CHART), "--namespace", "kubeinfer-system",
                 "--kube-version", KUBE_VERSION, *flags)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def is_hook(doc: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The release's own objects of a kind (hooks such as the `helm test` pod left out)."""
    return [d for d in docs if d["kind"] == kind and not is_hook(d)]


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    return by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_lint_is_clean(helm: str) -> None:
    result = run(helm, "lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_install_is_cluster_wide_with_crds(helm: str) -> None:
    docs = render(helm)
    crds = {d["metadata"]["name"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    assert set(crds) == {api.CRD_NAME, "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    assert crds[api.CRD_NAME]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert "--all-namespaces" in operator_args(docs) and "--peering-name=kubeinfer" in operator_args(docs)
    role = by_kind(docs, "ClusterRole")[0]
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"inferenceservices", "inferenceservices/status", "deployments", "services",
            "poddisruptionbudgets", "pods", "events", "clusterkopfpeerings"} <= resources
    assert not by_kind(docs, "Role")
    secret_verbs = {v for rule in role["rules"] if "secrets" in rule["resources"] for v in rule["verbs"]}
    assert secret_verbs == {"create"}  # least privilege: the operator never reads Secrets


def test_namespaced_install_uses_roles(helm: str) -> None:
    docs = render(helm, "watch.namespaces={team-a,team-b}")
    args = operator_args(docs)
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    assert sorted(r["metadata"]["namespace"] for r in by_kind(docs, "Role")) == ["team-a", "team-b"]
    cluster_resources = {r for rule in by_kind(docs, "ClusterRole")[0]["rules"] for r in rule["resources"]}
    assert cluster_resources == {"customresourcedefinitions", "namespaces", "nodes"}


def test_crds_can_be_left_out(helm: str) -> None:
    assert not by_kind(render(helm, "crds.install=false"), "CustomResourceDefinition")


def test_gie_inference_pool_crd_when_asked(helm: str) -> None:
    """crds.gie: GIE's InferencePool v1 CRD (what spec.inferencePool renders), with the chart's labels."""
    crds = {d["metadata"]["name"]: d for d in by_kind(render(helm, "crds.gie=true"), "CustomResourceDefinition")}
    pool = crds[POOL_CRD]
    assert pool["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == api.GIE_VERSION
    assert [v["name"] for v in pool["spec"]["versions"] if v["served"]] == ["v1"]
    assert pool["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert POOL_CRD not in {d["metadata"]["name"] for d in by_kind(render(helm), "CustomResourceDefinition")}


def test_operator_pod_is_restricted_and_probed(helm: str) -> None:
    pod = by_kind(render(helm), "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["image"] == "kubeinfer/kubeinfer:0.1.0"


def test_monitoring_objects_are_optional(helm: str) -> None:
    assert not by_kind(render(helm), "PodMonitor")
    docs = render(helm, "metrics.podMonitor.enabled=true", "metrics.serviceMonitor.enabled=true")
    assert by_kind(docs, "PodMonitor")[0]["spec"]["namespaceSelector"] == {"any": True}
    components = {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: m
                  for m in by_kind(docs, "PodMonitor")}
    # the engines, the routers in front of them and spec.inferencePool's endpoint pickers
    assert set(components) == {"engine", "gateway", "endpoint-picker"}
    assert components["gateway"]["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["targetLabel"] == "inferenceservice"
    assert components["endpoint-picker"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] == "metrics"


def test_dashboard_uses_the_engine_metric_names(helm: str) -> None:
    config_map = next(d for d in by_kind(render(helm), "ConfigMap") if "dashboard" in d["metadata"]["name"])
    dashboard = config_map["data"]["kubeinfer-engines.json"]
    for metric in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:time_to_first_token_seconds", "kubeinfer_operator_reconciles_total"):
        assert metric in dashboard


def _exported_names() -> set[str]:
    """Every sample name a router (GatewayMetrics) or an engine (ServerMetrics) exposes."""
    from kubeinfer.server.router.activator import GatewayMetrics
    from kubeinfer.server.api.metrics import ServerMetrics
    from kubeinfer.server.engine.stats import EngineStats

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    registries = [GatewayMetrics().registry, ServerMetrics(EngineStats, "m", lambda: 0).registry]
    return {family.name + suffix for registry in registries for family in registry.collect()
            for suffix in suffixes.get(family.type, ("",))}


def test_routing_dashboard_reads_what_the_routers_and_engines_export(helm: str) -> None:
    import re

    config_map = next(d for d in by_kind(render(helm), "ConfigMap") if "dashboard" in d["metadata"]["name"])
    dashboard = json.loads(config_map["data"]["kubeinfer-routing.json"])
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\b(?:vllm|kubeinfer):[a-z_]+", expr)}
    assert used - _exported_names() == set()
    for metric in ("vllm:prefix_cache_hits_total", "vllm:request_success_total",
                   "kubeinfer:router_overhead_seconds_bucket", "kubeinfer:router_warmup_requests_total",
                   "kubeinfer:prefix_cache_hits_recent"):
        assert metric in used   # hit rate and requests per engine, router overhead, warm-up, deletion cost
    assert dashboard["uid"] != json.loads(config_map["data"]["kubeinfer-engines.json"])["uid"]


def test_tenants_dashboard_reads_the_per_tenant_metrics(helm: str) -> None:
    """Per-tenant TTFT, throughput, queue and refusals, from what `Tenancy` registers."""
    import json
    import re

    from prometheus_client import CollectorRegistry

    from kubeinfer.server.api.tenancy import TenantMetrics

    registry = CollectorRegistry()
    TenantMetrics(registry, "m")
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}
    config_map = next(d for d in by_kind(render(helm), "ConfigMap") if "dashboard" in d["metadata"]["name"])
    dashboard = json.loads(config_map["data"]["kubeinfer-tenants.json"])
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\b(?:vllm|kubeinfer):[a-z_]+", expr)}
    assert used <= exported and len(used) == 6
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for word in ("TTFT", "tokens per second", "Queue", "Refusals"):
        assert word in titles


def test_helm_test_hook_is_rendered(helm: str) -> None:
    pods = [d for d in render(helm) if d["kind"] == "Pod" and is_hook(d)]
    assert len(pods) == 1 and pods[0]["spec"]["restartPolicy"] == "Never"


def test_values_schema_refuses_bad_values(helm: str) -> None:
    result = run(helm, "template", "kubeinfer", str(CHART), "--kube-version", KUBE_VERSION,
                 "--set", "operator.logLevel=loud")
    assert result.returncode != 0 and "logLevel" in result.stderr


def test_the_operator_creates_secrets_and_never_reads_one(helm: str) -> None:
    """Cluster-wide and per watched namespace: `create` (each service's block-hash key), no
    get/list/watch/patch (a patch answers the object: it reads too)."""
    for docs in (render(helm), render(helm, "watch.namespaces={team-a}")):
        for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
            verbs = {verb for rule in role["rules"] for verb in rule["verbs"]
                     if "secrets" in rule.get("resources", []) or "*" in rule.get("resources", [])}
            assert verbs <= {"create"}, (role["metadata"]["name"], verbs)
        assert any({"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]} in role["rules"]
                   for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"))

def test_allowed_images_and_network_policy_reach_the_operator(helm: str) -> None:
    docs = render(helm, "allowedImages={registry.example.com/kubeinfer/*}", "networkPolicy.enabled=true",
                  "networkPolicy.allowFrom[0].namespaceSelector.matchLabels.team=monitoring")
    args = operator_args(docs)
    assert "--allowed-image=registry.example.com/kubeinfer/*" in args and "--network-policy" in args
    allow = next(a for a in args if a.startswith("--network-policy-allow-from="))
    assert json.loads(allow.split("=", 1)[1]) == [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
    rules = by_kind(docs, "ClusterRole")[0]["rules"]
    assert {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
            "verbs": ["get", "create", "patch", "update", "delete"]} in rules
    defaults = render(helm)
    assert not any(a.startswith(("--allowed-image", "--network-policy")) for a in operator_args(defaults))
    assert not any("networkpolicies" in r["resources"] for r in by_kind(defaults, "ClusterRole")[0]["rules"])


def test_tracing_endpoint_reaches_the_operator_and_its_engines(helm: str) -> None:
    """The chart's tracing.otlpEndpoint becomes the operator's default for engines whose
    InferenceService sets none; a bad one is refused by the values schema."""
    import argparse

    from isvc_builders import make_isvc

    from kubeinfer.operator.build import deployment
    from kubeinfer.operator.main import add_arguments
    from kubeinfer.operator.resource import OperatorConfig

    endpoint = "http://otel-collector.observability:4318/v1/traces"
    operator = by_kind(render(helm, f"tracing.otlpEndpoint={endpoint}"), "Deployment")[0]
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--otlp-traces-endpoint={endpoint}" in args
    assert not any(a.startswith("--otlp") for a in by_kind(render(helm), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed, _ = parser.parse_known_args(args[1:])
    assert parsed.otlp_traces_endpoint == endpoint
    config = OperatorConfig(otlp_traces_endpoint=endpoint)
    env = {e["name"]: e.get("value") for e in deployment(make_isvc({}), config)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBEINFER_OTLP_TRACES_ENDPOINT"] == endpoint
    own = make_isvc({"tracing": {"otlpEndpoint": "http://mine:4318/v1/traces"}})
    env = {e["name"]: e.get("value") for e in deployment(own, config)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBEINFER_OTLP_TRACES_ENDPOINT"] == "http://mine:4318/v1/traces"   # the service's own wins
    refused = run(helm, "template", "kubeinfer", str(CHART), "--kube-version", KUBE_VERSION,
                  "--set", "tracing.otlpEndpoint=collector:4318")
    assert refused.returncode != 0 and "otlpEndpoint" in refused.stderr


def test_model_cache_settings_reach_the_operator(helm: str) -> None:
    assert "--model-cache-path=/var/lib/kubeinfer/models" in operator_args(render(helm))
    args = operator_args(render(helm, "modelCache.claimName=models", "modelCache.budget=500Gi",
                                "modelCache.hfEndpoint=http://hub-mirror.internal"))
    assert {"--model-cache-claim=models", "--model-cache-budget=500Gi", "--hf-endpoint=http://hub-mirror.internal"} \
        <= set(args)
    result = run(helm, "template", "kubeinfer", str(CHART), "--kube-version", KUBE_VERSION,
                 "--set", "modelCache.budget=lots")
    assert result.returncode != 0 and "budget" in result.stderr
