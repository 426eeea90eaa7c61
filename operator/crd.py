"""Generate the InferenceService CRD from the pydantic models.

`python -m kubeinfer.operator.crd --write` regenerates the committed files (crds/ and the Helm
chart's copy; without --write the InferenceService CRD goes to stdout); a unit test fails when
they drift. Pydantic emits JSON Schema; Kubernetes
wants a *structural* OpenAPI v3 subset, so refs are inlined, `Optional` unwrapped, titles
dropped and free-form objects marked `x-kubernetes-preserve-unknown-fields`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from . import api
from .spec import InferenceServiceSpec, rules
from .status import InferenceServiceStatus

REPO = Path(__file__).resolve().parents[1]
CHART_CRDS = Path("helm/kubeinfer/files/crds")
NAME_RULES = rules(
    (f"self.metadata.name.size() <= {api.MAX_NAME_LENGTH}",
     f"metadata.name must be at most {api.MAX_NAME_LENGTH} characters, so the names of the "
     "Deployment, Service and pods derived from it stay valid"),
    ("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
     "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
     "with a letter), because it names the Service"),
    ("!self.metadata.name.endsWith('-gateway')",
     "metadata.name must not end in '-gateway': the scale-from-zero gateway of the "
     "InferenceService named without that suffix uses those names"),
)
PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Replicas", "type": "string", "jsonPath": ".status.replicaSummary",
     "description": "ready/desired replicas"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
    {"name": "Served", "type": "string", "jsonPath": ".status.servedModelName",
     "description": "the model id clients send"},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.engine.tensorParallelSize",
     "description": "tensor-parallel size"},
    {"name": "PP", "type": "integer", "jsonPath": ".spec.engine.pipelineParallelSize", "priority": 1,
     "description": "pipeline stages"},
    {"name": "Pods", "type": "integer", "jsonPath": ".spec.engine.podsPerReplica", "priority": 1,
     "description": "pods per replica (a LeaderWorkerSet group when more than 1)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
]


def structural(node: Any, defs: dict[str, Any]) -> Any:
    """Rewrite one pydantic JSON-Schema node into Kubernetes' structural OpenAPI form."""
    if isinstance(node, list):
        return [structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:  # a field's own keys (description, default) override the model's
        # a copy: a model used twice must not share lists (YAML would write them as anchors)
        node = {**copy.deepcopy(defs[node.pop("$ref").split("/")[-1]]), **node}
    branches = [b for b in node.get("anyOf", []) if b.get("type") != "null"]
    if "anyOf" in node and len(branches) == 1:  # `X | None`: absent means None
        del node["anyOf"]
        node = {**structural(branches[0], defs), **node}
    node.pop("title", None)
    if node.get("default", 0) is None:
        del node["default"]
    for bound in ("Minimum", "Maximum"):
        if isinstance(node.get("exclusive" + bound), (int, float)):
            node[bound.lower()] = node.pop("exclusive" + bound)
            node["exclusive" + bound] = True
    if node.get("additionalProperties") is True:
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = structural(node[key], defs)
    if "properties" in node:
        node["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
    return node


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    return structural(schema, schema.pop("$defs", {}))


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object, ready for `kubectl apply`."""
    root = {
        "type": "object",
        "description": "InferenceService serves one model with kubeinfer engine pods behind a "
                       "Service; an operator keeps them, their rollout and their status in line.",
        "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {**model_schema(InferenceServiceSpec), "default": {}},
            "status": model_schema(InferenceServiceStatus),
        },
        **NAME_RULES,
    }
    version = {
        "name": api.VERSION, "served": True, "storage": True,
        "schema": {"openAPIV3Schema": root},
        "subresources": {"status": {}, "scale": {
            "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector"}},
        "additionalPrinterColumns": PRINTER_COLUMNS,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": api.CRD_NAME, "labels": {"app.kubernetes.io/part-of": "kubeinfer"}},
        "spec": {"group": api.GROUP, "scope": "Namespaced", "versions": [version],
                 "names": {"kind": api.KIND, "plural": api.PLURAL, "singular": api.SINGULAR,
                           "listKind": api.KIND + "List", "shortNames": list(api.SHORT_NAMES),
                           "categories": list(api.CATEGORIES)}},
    }


def peering_crds() -> list[dict[str, Any]]:
    """kopf's own peering CRDs: replicas of the operator heartbeat into these objects."""
    def one(kind: str, scope: str) -> dict[str, Any]:
        plural = kind.lower() + "s"
        return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.kopf.dev"},
                "spec": {"group": "kopf.dev", "scope": scope,
                         "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                         "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                             "openAPIV3Schema": {"type": "object", "properties": {"status": {
                                 "type": "object",
                                 "x-kubernetes-preserve-unknown-fields": True}}}}}]}}
    return [one("ClusterKopfPeering", "Cluster"), one("KopfPeering", "Namespaced")]


HEADER = "# Generated by `python -m kubeinfer.operator.crd --write` from operator/; do not edit.\n"


def render(objects: list[dict[str, Any]] | None = None) -> str:
    documents = [yaml.safe_dump(o, sort_keys=False, width=100) for o in objects or [crd()]]
    return HEADER + "---\n".join(documents)


def generated_files(repo: Path) -> dict[Path, str]:
    """Every generated file: the repo's crds/ and the chart's copy (charts cannot reach out)."""
    files = {f"{api.CRD_NAME}.yaml": render(), "kopf-peerings.kopf.dev.yaml": render(peering_crds())}
    return {folder / name: text for folder in (repo / "crds", repo / CHART_CRDS)
            for name, text in files.items()}


def main(argv: list[str]) -> int:
    if argv[1:] == ["--write"]:
        for path, text in generated_files(REPO).items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
