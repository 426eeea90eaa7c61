"""spec.auth → pods: API keys reach engines and the gateway from the Secret as env, never as
an argument, and the pods refuse to start open if the Secret holds no key."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from isvc_builders import CONFIG, make_isvc
from pydantic import ValidationError

from kubeinfer.operator.children import desired_children
from kubeinfer.operator.resource import InferenceService
from kubeinfer.operator.spec import InferenceServiceSpec
from kubeinfer.server.flags import SERVER_FLAGS, add_flags

pytestmark = pytest.mark.unit

AUTH = {"auth": {"apiKeySecretRef": {"name": "chat-api-keys", "key": "keys"}}}
SCALE_TO_ZERO = {"autoscaling": {"enabled": True, "minReplicas": 0}}


def deployments(spec: dict) -> dict[str, dict]:
    return {c["metadata"]["name"]: c for c in desired_children(make_isvc(spec), CONFIG)
            if c["kind"] == "Deployment"}


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(deployment: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(deployment)["env"]}


def test_engine_gets_the_keys_from_the_secret_as_env_not_args() -> None:
    engine = container(deployments(AUTH)["chat"])
    env = {e["name"]: e for e in engine["env"]}
    assert env["KUBEINFER_API_KEYS"] == {"name": "KUBEINFER_API_KEYS", "valueFrom": {
        "secretKeyRef": {"name": "chat-api-keys", "key": "keys"}}}
    assert env["KUBEINFER_REQUIRE_API_KEY"]["value"] == "true"
    argv = " ".join(engine["command"] + engine["args"])
    assert "api-key" not in argv and "chat-api-keys" not in argv


def test_env_names_are_the_flags_the_engine_reads() -> None:
    """The env the operator sets parses, through the shared flag table, into the serve flags."""
    parser = argparse.ArgumentParser()
    add_flags(parser, SERVER_FLAGS, environ={"KUBEINFER_API_KEYS": "sk-a\nsk-b",
                                             "KUBEINFER_REQUIRE_API_KEY": "true"})
    args = parser.parse_args([])
    assert args.api_keys == ["sk-a", "sk-b"] and args.require_api_key is True


def test_key_defaults_to_api_keys() -> None:
    env = env_of(deployments({"auth": {"apiKeySecretRef": {"name": "k"}}})["chat"])
    assert env["KUBEINFER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "k",
                                                                      "key": "api-keys"}


def test_without_auth_no_key_env() -> None:
    for deployment in deployments(SCALE_TO_ZERO).values():
        assert not {"KUBEINFER_API_KEYS", "KUBEINFER_REQUIRE_API_KEY"} & set(env_of(deployment))


def test_the_gateway_checks_the_same_keys_without_reading_secrets() -> None:
    spec = {**AUTH, **SCALE_TO_ZERO}
    gateway = deployments(spec)["chat-gateway"]
    assert env_of(gateway)["KUBEINFER_API_KEYS"] == env_of(deployments(spec)["chat"])[
        "KUBEINFER_API_KEYS"]
    assert env_of(gateway)["KUBEINFER_REQUIRE_API_KEY"]["value"] == "true"
    assert "chat-api-keys" not in " ".join(container(gateway)["args"])
    role = next(c for c in desired_children(make_isvc(spec), CONFIG) if c["kind"] == "Role")
    # the kubelet resolves secretKeyRef for the pod: the gateway's own identity never reads it
    assert "secrets" not in json.dumps(role["rules"])


def test_users_engine_env_still_wins() -> None:
    spec = {**AUTH, "engine": {"env": [{"name": "KUBEINFER_API_KEYS",
                                        "valueFrom": {"secretKeyRef": {"name": "other",
                                                                       "key": "k"}}}]}}
    env = env_of(deployments(spec)["chat"])
    assert env["KUBEINFER_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "other"


@pytest.mark.parametrize("ref", [{"name": "Bad_Name"}, {"name": ""}, {"key": "keys"},
                                 {"name": "ok", "key": "a/b"}])
def test_bad_secret_refs_are_refused(ref: dict) -> None:
    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate({"auth": {"apiKeySecretRef": ref}})


def test_api_keys_example_uses_its_secret() -> None:
    example = Path(__file__).resolve().parents[2] / "crds" / "examples" / "api-keys.yaml"
    manifest = yaml.safe_load(example.read_text())
    manifest["metadata"].update(namespace="default", uid="u")
    engine = desired_children(InferenceService.from_body(manifest), CONFIG)[0]
    assert env_of(engine)["KUBEINFER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "smollm2-api-keys", "key": "api-keys"}
