"""Unit tests (no cluster) for how the pod runner builds a container's env and command line."""
from __future__ import annotations

import pytest

from e2e.localcluster.podenv import ConfigError, command_line, expand, field_value
from e2e.localcluster.runner_rules import runner_managed, runner_managed_jq

pytestmark = pytest.mark.unit

POD = {"metadata": {"name": "engine-0", "namespace": "ml", "uid": "u-1", "labels": {"app": "llm"}},
       "spec": {"nodeName": "kubeinfer-gpu-0", "serviceAccountName": "engine",
                "containers": [{"name": "engine", "image": "kubeinfer/kubeinfer:latest"}]},
       "status": {"podIP": "127.1.1.7", "podIPs": [{"ip": "127.1.1.7"}], "hostIP": "127.0.0.1"}}


def test_expand_follows_kubernetes_rules() -> None:
    env = {"POD_IP": "127.1.1.7", "PORT": "8000"}
    assert expand("--host=$(POD_IP):$(PORT)", env) == "--host=127.1.1.7:8000"
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert expand("$$(POD_IP) is escaped", env) == "$(POD_IP) is escaped"


@pytest.mark.parametrize(("path", "value"), [
    ("metadata.name", "engine-0"), ("metadata.namespace", "ml"), ("metadata.labels['app']", "llm"),
    ("metadata.annotations['none']", ""), ("spec.nodeName", "kubeinfer-gpu-0"), ("status.podIP", "127.1.1.7"),
    ("status.podIPs", "127.1.1.7"), ("spec.serviceAccountName", "engine")])
def test_field_ref_values(path: str, value: str) -> None:
    assert field_value(POD, path) == value


def test_unknown_field_ref_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="metadata.generation"):
        field_value(POD, "metadata.generation")


def test_command_line_uses_image_entrypoint_when_command_is_unset() -> None:
    container = {"args": ["serve", "--port", "$(PORT)"]}
    assert command_line(container, {"PORT": "9000"}, ["kubeinfer"]) == ["kubeinfer", "serve", "--port", "9000"]
    assert command_line({"command": ["python"], "args": ["-V"]}, {}, ["kubeinfer"]) == ["python", "-V"]


def test_runner_rule_matches_our_images_unless_simulated() -> None:
    assert runner_managed(POD, ("kubeinfer/",))
    assert not runner_managed({**POD, "spec": {"containers": [{"image": "nginx"}]}}, ("kubeinfer/",))
    simulated = {**POD, "metadata": {**POD["metadata"], "labels": {"kubeinfer.io/simulate": "true"}}}
    assert not runner_managed(simulated, ("kubeinfer/",))
    assert 'startswith("kubeinfer/")' in runner_managed_jq(("kubeinfer/",))
