"""spec.tenancy and spec.tracing -> engine and router pods: the tenant file's Secret mounted
read-only and named by the flags' env vars, each router replica told its share of the quotas,
the tracing endpoint passed to the engines; the same env parses as `kubeinfer serve` and
`kubeinfer route` flags; nothing rendered when the sections are empty."""

from __future__ import annotations

import argparse

import pytest
from isvc_builders import CONFIG, make_isvc
from pydantic import ValidationError

from kubeinfer.operator.build import deployment
from kubeinfer.operator.router_build import gateway_deployment
from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS, add_flags
from kubeinfer.server.router.cli import add_arguments as route_arguments

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
