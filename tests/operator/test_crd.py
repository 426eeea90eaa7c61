"""The committed CRD is generated from the pydantic models and reads well in `kubectl explain`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from kubeinfer.operator import api
from kubeinfer.operator.crd import crd, generated_files

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / f"{api.CRD_NAME}.yaml"


def walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], f"{path}[]")


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crds_match_the_models() -> None:
    for path, text in generated_files(REPO).items():
        assert path.read_text() == text, (
            f"{path.relative_to(REPO)} drifted from operator/spec.py: run "
            "`python -m kubeinfer.operator.crd --write`")


def test_schema_is_structural() -> None:
    forbidden = {"$ref", "$defs", "title", "anyOf", "additionalProperties", "propertyNames"}
    for path, node in walk(schema()):
        leftovers = forbidden & node.keys()
        if node.get("additionalProperties") not in (None, True) and leftovers == {"additionalProperties"}:
            continue  # a typed map (nodeSelector) is structural
        assert not leftovers, f"{path}: {leftovers}"
        free = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
        assert "type" in node or free, f"{path} has no type"
        assert node.get("default", 0) is not None, f"{path} defaults to null"


def test_every_spec_and_status_field_is_described() -> None:
    for top in ("spec", "status"):
        for path, node in walk(schema()["properties"][top], top):
            assert node.get("description") or path.endswith("[]"), f"{path} has no description"


def test_cross_field_rules_are_cel() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    rules = [r["rule"] for r in spec["autoscaling"]["x-kubernetes-validations"]]
    assert "self.minReplicas <= self.maxReplicas" in rules
    routing = spec["routing"]
    assert [r["message"] for r in routing["x-kubernetes-validations"]] == [
        "routing.replicas must be at least 1 unless routing.strategy is none"]
    assert routing["properties"]["strategy"]["enum"] == ["prefix-aware", "least-load", "round-robin", "none"]
    assert routing["default"]["strategy"] == "prefix-aware"
    tp = spec["engine"]["properties"]["tensorParallelSize"]
    assert (tp["minimum"], tp["maximum"], tp["default"]) == (1, 8, 1)
    name_rules = [r["rule"] for r in schema()["x-kubernetes-validations"]]
    assert f"self.metadata.name.size() <= {api.MAX_NAME_LENGTH}" in name_rules


def test_scale_status_and_printer_columns() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    assert version["subresources"]["status"] == {}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Ready", "Replicas", "Model", "Served", "TP", "PP", "Pods", "Age", "URL"]
    assert columns["Served"]["jsonPath"] == ".status.servedModelName"
    assert columns["URL"]["priority"] == 1


def test_short_names_avoid_kserve() -> None:
    names = crd()["spec"]["names"]
    assert "isvc" not in names["shortNames"] and names["kind"] == "InferenceService"


def test_yaml_parses_as_one_document() -> None:
    assert yaml.safe_load(CRD_FILE.read_text())["metadata"]["name"] == api.CRD_NAME
