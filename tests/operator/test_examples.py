"""The shipped InferenceService examples parse against the spec and build valid children."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from isvc_builders import CONFIG

from kubeinfer.operator import api
from kubeinfer.operator.children import desired_children
from kubeinfer.operator.resource import InferenceService

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "crds" / "examples"
OURS = ["embedded-model.yaml", "tp2-gpu-pvc.yaml", "autoscaled.yaml", "api-keys.yaml", "tenants.yaml", "qwen3.yaml",
        "gemma.yaml", "fp8.yaml"]


@pytest.mark.parametrize("name", OURS)
def test_example_builds(name: str) -> None:
    manifest = yaml.safe_load((EXAMPLES / name).read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == (api.API_VERSION, api.KIND)
    manifest["metadata"].update(namespace="default", uid="u", generation=1)
    isvc = InferenceService.from_body(manifest)
    kinds = [c["kind"] for c in desired_children(isvc, CONFIG)]
    assert kinds[0] == "Deployment" and "Service" in kinds   # the engines first, the router before the Service
    assert len(isvc.name) <= api.MAX_NAME_LENGTH


def test_tp2_example_requests_two_gpus_per_pod() -> None:
    manifest = yaml.safe_load((EXAMPLES / "tp2-gpu-pvc.yaml").read_text())
    manifest["metadata"].update(namespace="default", uid="u")
    dep = desired_children(InferenceService.from_body(manifest), CONFIG)[0]
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2


def test_fp8_example_asks_for_its_checkpoint_format() -> None:
    manifest = yaml.safe_load((EXAMPLES / "fp8.yaml").read_text())
    manifest["metadata"].update(namespace="default", uid="u")
    args = desired_children(InferenceService.from_body(manifest), CONFIG)[0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--quantization") + 1] == "compressed-tensors"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
