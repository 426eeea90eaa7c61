"""spec.tenancy, spec.tracing and the router's queue -> engine and router pods: the tenant file's
Secret, or the inline table (a pod annotation read through the downward API) with each tenant's
keys Secret beside it, mounted read-only and named by the flags' env vars; each router replica
told its share of the quotas; the tracing endpoint passed to the engines; the queue's limits as
router flags. The same env and files parse with `kubeinfer serve` / `kubeinfer route`'s own
parsers; nothing is rendered when the sections are empty; bad tables are refused."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
from isvc_builders import CONFIG, make_isvc
from pydantic import ValidationError

from kubeinfer.operator import api
from kubeinfer.operator.build import TENANTS_DIR, deployment, leader_worker_set
from kubeinfer.operator.children import desired_children
from kubeinfer.operator.crd import crd
from kubeinfer.operator.reconcile import pod_templates, spec_error
from kubeinfer.operator.router_build import gateway_deployment
from kubeinfer.operator.spec import InferenceServiceSpec
from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS, add_flags
from kubeinfer.server.router.cli import add_arguments as route_arguments
from kubeinfer.server.credentials import CredentialFiles

pytestmark = pytest.mark.unit

TENANCY = {"tenancy": {"tenantsSecretRef": {"name": "teams"}, "trustTenantHeader": True},
           "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318/v1/traces", "samplingRatio": 0.25},
           "routing": {"replicas": 3}}


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_engines_mount_the_tenant_file_and_get_the_tracing_endpoint() -> None:
    pod = deployment(make_isvc(TENANCY), CONFIG)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "tenants", "secret": {"secretName": "teams", "items": [
        {"key": "tenants.yaml", "path": "tenants.yaml"}]}} in pod["volumes"]
    assert {"name": "tenants", "mountPath": "/etc/kubeinfer/tenants", "readOnly": True} in container["volumeMounts"]
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS + SERVER_FLAGS, environ=env_of(container))
    args = parser.parse_args([])
    assert args.tenants_file == "/etc/kubeinfer/tenants/tenants.yaml" and args.trust_tenant_header is True
    assert args.otlp_traces_endpoint == "http://otel-collector.observability:4318/v1/traces"
    assert args.otlp_traces_sampling_ratio == 0.25


def test_each_router_replica_enforces_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    isvc = make_isvc(TENANCY)
    pod = gateway_deployment(isvc, CONFIG, {"name": "llm-gateway", "labels": {}})["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["volumes"][0]["secret"]["secretName"] == "teams"
    assert container["volumeMounts"][0]["readOnly"] is True
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    route_arguments(parser)   # reads the environment, as in the pod
    args = parser.parse_args([])
    assert (args.tenants_file, args.trust_tenant_header, args.quota_replicas) == (
        "/etc/kubeinfer/tenants/tenants.yaml", True, 3)


def test_nothing_is_rendered_without_tenancy_or_tracing() -> None:
    container = deployment(make_isvc({}), CONFIG)["spec"]["template"]["spec"]["containers"][0]
    names = {e["name"] for e in container["env"]}
    assert not names & {"KUBEINFER_TENANTS_FILE", "KUBEINFER_TRUST_TENANT_HEADER", "KUBEINFER_OTLP_TRACES_ENDPOINT"}
    assert all(m["name"] != "tenants" for m in container["volumeMounts"])


@pytest.mark.parametrize("spec", [{"tracing": {"otlpEndpoint": "collector:4318"}},
                                  {"tracing": {"samplingRatio": 2}},
                                  {"tenancy": {"tenantsSecretRef": {"name": "Bad_Name"}}}])
def test_bad_settings_are_refused(spec: dict) -> None:
    with pytest.raises(ValidationError):
        make_isvc(spec)


INLINE = {"tenancy": {
    "priorityRange": {"min": 0, "max": 10}, "objectives": {"interactive": 0, "batch": 8},
    "tenants": [
        {"name": "team-a", "priority": 2, "quotas": {"tokensPerMinute": 60000, "requestsPerMinute": 120},
         "apiKeysSecretRef": {"name": "team-keys", "key": "team-a"}},
        {"name": "team-b", "priority": 5, "apiKeysSecretRef": {"name": "team-keys", "key": "team-b"}},
        {"name": "batch-jobs", "priority": 8, "apiKeysSecretRef": {"name": "batch-keys"}},
        {"name": "gateway-only"}]},
    "routing": {"replicas": 2}}
SECRETS = {"team-keys": {"team-a": "sk-a-1\nsk-a-2\n", "team-b": "  sk-b-1  \n\n"},
           "batch-keys": {"api-keys": "# the batch runner\nsk-batch-1\n"}}


def materialize(pod: dict[str, Any], root: Path) -> Path:
    """What the kubelet writes for the `tenants` volume, under `root`: the downward API file from
    the pod's annotation and each projected Secret key at its item's path."""
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "tenants")
    for source in volume["projected"]["sources"]:
        if "downwardAPI" in source:
            (item,) = source["downwardAPI"]["items"]
            assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{api.TENANTS_ANNOTATION}']"
            (root / item["path"]).write_text(pod["metadata"]["annotations"][api.TENANTS_ANNOTATION])
        for item in source.get("secret", {}).get("items", []):
            path = root / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(SECRETS[source["secret"]["name"]][item["key"]])
    return root


def at_root(path: str, root: Path) -> str:
    return str(root / Path(path).relative_to(TENANTS_DIR))


def test_inline_table_reaches_the_engines_without_keys_and_parses_back(tmp_path: Path) -> None:
    template = deployment(make_isvc(INLINE), CONFIG)["spec"]["template"]
    rendered = json.dumps(template)
    assert not any(key in rendered for keys in SECRETS.values() for text in keys.values()
                   for key in text.split() if key.startswith("sk-"))
    container = template["spec"]["containers"][0]
    assert {"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True} in container["volumeMounts"]
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS + SERVER_FLAGS, environ=env_of(container))
    args = parser.parse_args([])
    args.tenants_file = at_root(args.tenants_file, materialize(template, tmp_path))
    table = CredentialFiles.from_args(args).current.table
    assert table is not None and table.priority_range == (0, 10) and table.objectives == {"interactive": 0, "batch": 8}
    tenants = table.by_name()
    assert tenants["team-a"].keys == ["sk-a-1", "sk-a-2"] and tenants["team-b"].keys == ["sk-b-1"]
    assert tenants["batch-jobs"].keys == ["sk-batch-1"] and tenants["gateway-only"].keys == []
    assert (tenants["team-a"].priority, tenants["team-a"].quotas.tokens_per_minute,
            tenants["team-a"].quotas.requests_per_minute) == (2, 60000, 120)
    assert tenants["batch-jobs"].priority == 8 and tenants["team-b"].quotas.tokens_per_minute is None


def test_router_replicas_read_the_inline_table_and_enforce_their_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isvc = make_isvc(INLINE)
    template = gateway_deployment(isvc, CONFIG, {"name": "chat-gateway", "labels": {}})["spec"]["template"]
    assert template["metadata"]["annotations"][api.TENANTS_ANNOTATION] == \
        deployment(isvc, CONFIG)["spec"]["template"]["metadata"]["annotations"][api.TENANTS_ANNOTATION]
    container = template["spec"]["containers"][0]
    assert container["volumeMounts"] == [{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}]
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    route_arguments(parser)
    args = parser.parse_args([])
    assert args.quota_replicas == 2
    args.tenants_file = at_root(args.tenants_file, materialize(template, tmp_path))
    table = CredentialFiles.from_args(args).current.table
    assert table is not None and table.by_name()["team-a"].keys == ["sk-a-1", "sk-a-2"]


def test_the_endpoint_picker_reads_the_table_and_enforces_its_share(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `spec.inferencePool`, the endpoint picker (the router behind Envoy's ext_proc) gets
    what the router gets: the table, the tenants' key Secrets, header trust, the engines' keys
    and block-hash secret, and its replicas' share of the quotas."""
    isvc = make_isvc({**INLINE, "tenancy": {**INLINE["tenancy"], "trustTenantHeader": True},
                      "inferencePool": {"enabled": True, "replicas": 3}})
    children = {(c["kind"], c["metadata"]["name"]): c for c in desired_children(isvc, CONFIG)}
    template = children[("Deployment", "chat-epp")]["spec"]["template"]
    router = gateway_deployment(isvc, CONFIG, {"name": "chat-gateway", "labels": {}})["spec"]["template"]
    assert template["metadata"]["annotations"][api.TENANTS_ANNOTATION] == \
        router["metadata"]["annotations"][api.TENANTS_ANNOTATION]
    assert template["spec"]["volumes"] == router["spec"]["volumes"]
    container, router_container = template["spec"]["containers"][0], router["spec"]["containers"][0]
    assert container["volumeMounts"] == [{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}]
    secret_env = [e for e in router_container["env"] if "valueFrom" in e and e["name"] != "POD_NAMESPACE"]
    assert secret_env and all(e in container["env"] for e in secret_env)   # block-hash secret, keys
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    route_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert args.ext_proc_port == 9002 and args.trust_tenant_header is True and args.quota_replicas == 3
    args.tenants_file = at_root(args.tenants_file, materialize(template, tmp_path))
    table = CredentialFiles.from_args(args).current.table
    assert table is not None and table.by_name()["team-b"].keys == ["sk-b-1"]


def test_without_tenancy_the_endpoint_picker_gets_no_tenant_file() -> None:
    children = {(c["kind"], c["metadata"]["name"]): c
                for c in desired_children(make_isvc({"inferencePool": {"enabled": True}}), CONFIG)}
    template = children[("Deployment", "chat-epp")]["spec"]["template"]
    assert "volumes" not in template["spec"] and api.TENANTS_ANNOTATION not in template["metadata"]["annotations"]
    names = {e["name"] for e in template["spec"]["containers"][0]["env"]}
    assert not names & {"KUBEINFER_TENANTS_FILE", "KUBEINFER_TRUST_TENANT_HEADER", "KUBEINFER_QUOTA_REPLICAS"}


def test_a_tenants_keys_secret_is_projected_once_per_key() -> None:
    spec = {"tenancy": {"tenants": [{"name": "a", "apiKeysSecretRef": {"name": "keys", "key": "k"}},
                                    {"name": "b", "apiKeysSecretRef": {"name": "keys", "key": "k"}}]}}
    volume = deployment(make_isvc(spec), CONFIG)["spec"]["template"]["spec"]["volumes"][-1]
    assert volume["projected"]["sources"][1] == {"secret": {"name": "keys", "items": [
        {"key": "k", "path": "keys/keys/k"}]}}


def test_multi_pod_groups_carry_the_table_on_both_templates() -> None:
    spec = {**INLINE, "engine": {"tensorParallelSize": 2, "podsPerReplica": 2}}
    templates = leader_worker_set(make_isvc(spec), CONFIG)["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert api.TENANTS_ANNOTATION in templates[role]["metadata"]["annotations"]
        assert any("projected" in v for v in templates[role]["spec"]["volumes"])


def test_editing_the_table_rolls_the_pods_and_only_then() -> None:
    """The pods read the table when they start (no reload), so a new table must be a new template."""
    def template(spec: dict) -> dict:
        return pod_templates(deployment(make_isvc(spec), CONFIG))
    changed = json.loads(json.dumps(INLINE))
    changed["tenancy"]["tenants"][0]["quotas"]["requestsPerMinute"] = 60
    assert template(INLINE) == template(json.loads(json.dumps(INLINE)))
    assert template(changed) != template(INLINE)


def test_the_router_queue_limits_are_rendered_as_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    def parsed(spec: dict) -> argparse.Namespace:
        container = gateway_deployment(make_isvc(spec), CONFIG, {"name": "g", "labels": {}})[
            "spec"]["template"]["spec"]["containers"][0]
        parser = argparse.ArgumentParser()
        route_arguments(parser)
        return parser.parse_args(container["args"][1:])
    defaults = parsed({})
    assert (defaults.max_in_flight_per_replica, defaults.max_queued_requests) == (0, 4096)
    args = parsed({"routing": {"maxInFlightPerReplica": 4, "maxQueuedRequests": 100}})
    assert (args.max_in_flight_per_replica, args.max_queued_requests) == (4, 100)


@pytest.mark.parametrize("routing", [{"maxInFlightPerReplica": -1}, {"maxQueuedRequests": 0}])
def test_bad_queue_limits_are_refused(routing: dict) -> None:
    with pytest.raises(ValidationError):
        make_isvc({"routing": routing})


def tenancy(**fields: Any) -> dict:
    return {"tenancy": fields}


@pytest.mark.parametrize("spec, message", [
    (tenancy(tenantsSecretRef={"name": "teams"}, tenants=[{"name": "a"}]), "mutually exclusive"),
    (tenancy(tenantsSecretRef={"name": "teams"}, priorityRange={"min": 0, "max": 3}), "mutually exclusive"),
    (tenancy(tenants=[{"name": "a"}, {"name": "b"}, {"name": "a"}]), "name must be unique"),
    (tenancy(tenants=[{"name": "bad name"}]), "tenants.0.name"),
    (tenancy(tenants=[{"name": "-a"}]), "tenants.0.name"),
    (tenancy(tenants=[{"name": "a", "priority": 7}], priorityRange={"min": 0, "max": 3}),
     "priority must lie within|outside tenancy.priorityRange"),
    (tenancy(tenants=[{"name": "a", "priority": 101}]), "outside tenancy.priorityRange"),
    (tenancy(priorityRange={"min": 5, "max": 1}), "min must not exceed"),
    (tenancy(objectives={"batch": 20}, priorityRange={"min": 0, "max": 10}), "objectives"),
    (tenancy(tenants=[{"name": "a", "quotas": {"tokensPerMinute": 0}}]), "tokensPerMinute"),
    (tenancy(tenants=[{"name": "a", "quotas": {"requestsPerMinute": 0}}]), "requestsPerMinute"),
    (tenancy(tenants=[{"name": "a", "apiKeysSecretRef": {"name": "Bad_Secret"}}]), "apiKeysSecretRef.name"),
])
def test_bad_tenant_tables_are_refused_with_the_field_named(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        InferenceServiceSpec.model_validate(spec)
    assert re.search(message, spec_error(refused.value)), spec_error(refused.value)


def test_the_api_server_checks_the_table_with_the_same_rules() -> None:
    tenancy_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["tenancy"]
    messages = [r["message"] for r in tenancy_schema["x-kubernetes-validations"]]
    assert any("mutually exclusive" in m for m in messages)
    assert any("priority must lie within" in m for m in messages)
    assert any("objectives must lie within" in m for m in messages)
    tenants = tenancy_schema["properties"]["tenants"]
    assert tenants["x-kubernetes-validations"][0]["message"] == "tenancy.tenants[].name must be unique"
    assert tenants["items"]["properties"]["quotas"]["properties"]["tokensPerMinute"]["minimum"] == 1
    assert "pattern" in tenants["items"]["properties"]["name"]
