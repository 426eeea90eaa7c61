"""The KEDA alternative: our ScaledObject example validated against KEDA's own CRD schema.

The CRD comes from KEDA's Go module at a pinned release (`go mod download`, cached in the Go
module cache), and unknown fields are refused, as the API server's strict field validation
would (what `kubectl apply` does by default).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kubeinfer.operator import api

pytestmark = pytest.mark.integration

KEDA_MODULE = "github.com/kedacore/keda/v2@v2.21.0"
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "crds/examples/keda-scaledobject.yaml"
OUR_CRD = REPO / f"crds/{api.CRD_NAME}.yaml"


@pytest.fixture(scope="module")
def scaledobject_schema() -> dict[str, Any]:
    if shutil.which("go") is None:
        pytest.skip("needs the Go toolchain to fetch KEDA's CRD from its module")
    listing = subprocess.run(["go", "mod", "download", "-json", KEDA_MODULE], check=True,
                             capture_output=True, text=True, timeout=600)
    module_dir = Path(json.loads(listing.stdout)["Dir"])
    crd = yaml.safe_load((module_dir / "config/crd/bases/keda.sh_scaledobjects.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Refuse fields the schema does not declare, except where Kubernetes keeps unknown ones."""
    if "properties" in schema and "additionalProperties" not in schema and \
            not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for child in (schema.get("properties") or {}).values():
        strict(child)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            strict(schema[key])
    return schema


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_is_a_valid_scaledobject(scaledobject_schema: dict[str, Any]) -> None:
    manifest = example()
    assert (manifest["apiVersion"], manifest["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    jsonschema.validate(manifest, scaledobject_schema)


def test_validation_catches_mistakes(scaledobject_schema: dict[str, Any]) -> None:
    typo = example()
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        jsonschema.validate(typo, scaledobject_schema)
    no_target = example()
    del no_target["spec"]["scaleTargetRef"]["name"]
    with pytest.raises(jsonschema.ValidationError, match="'name' is a required property"):
        jsonschema.validate(no_target, scaledobject_schema)


def test_example_targets_our_scale_subresource_with_the_queue_depth_query() -> None:
    spec = example()["spec"]
    assert spec["scaleTargetRef"]["apiVersion"] == api.API_VERSION
    assert spec["scaleTargetRef"]["kind"] == api.KIND
    ours = yaml.safe_load(OUR_CRD.read_text())
    served = [v for v in ours["spec"]["versions"] if v["name"] == api.VERSION and v["served"]]
    assert served[0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    trigger = spec["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert "sum(vllm:num_requests_waiting{" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0
