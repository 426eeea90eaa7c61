"""The spec models: defaults come from the engine flags; bad values are refused clearly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kubeinfer.operator.spec import InferenceServiceSpec
from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS

pytestmark = pytest.mark.unit


def test_defaults_follow_the_engine_flags() -> None:
    spec = InferenceServiceSpec()
    flags = {f.dest: f.default for f in ENGINE_FLAGS + SERVER_FLAGS}
    assert spec.model.source == flags["model"] == "embedded"
    assert spec.engine.block_size == flags["block_size"]
    assert spec.engine.max_num_seqs == flags["max_num_seqs"]
    assert spec.engine.max_num_batched_tokens == flags["max_num_batched_tokens"]
    assert spec.engine.kv_cache_memory_fraction == flags["gpu_memory_utilization"]
    assert spec.engine.prefix_cache.enabled is flags["enable_prefix_caching"]
    assert spec.rollout.drain_seconds == flags["shutdown_timeout"]


def test_accepts_camel_case_like_the_api() -> None:
    spec = InferenceServiceSpec.model_validate({
        "model": {"source": "pvc://weights/qwen/model.gguf", "servedName": "qwen"},
        "engine": {"tensorParallelSize": 2, "prefixCache": {"enabled": False}},
        "resources": {"gpuProduct": "NVIDIA-L4", "cpu": 4, "memory": "16Gi"}})
    assert spec.engine.tensor_parallel_size == 2 and not spec.engine.prefix_cache.enabled
    assert spec.resources.cpu == 4 and spec.model.served_name == "qwen"


@pytest.mark.parametrize("source", ["embedded", "pvc://models", "pvc://models/llama-3/",
                                    "pvc://m-1/a/b.gguf", "hf://Qwen/Qwen2.5-0.5B-Instruct",
                                    "hf://org/m@main", "hf://org/m@0123456789abcdef0123456789abcdef01234567",
                                    "hf://org/m@refs/pr/1", "s3://bucket/model", "s3://my.bucket"])
def test_model_sources_accepted(source: str) -> None:
    assert InferenceServiceSpec.model_validate({"model": {"source": source}}).model.source == source


@pytest.mark.parametrize("source", ["gs://bucket/model", "hf://just-a-name", "pvc://UPPER/x",
                                    "/abs/path", "", "hf://org/m@", "s3://UPPER/x", "s3://b/x@v1"])
def test_unknown_model_sources_refused(source: str) -> None:
    with pytest.raises(ValidationError, match="model source"):
        InferenceServiceSpec.model_validate({"model": {"source": source}})


@pytest.mark.parametrize(("model", "message"), [
    ({"source": "s3://b1/x", "tokenSecretRef": {"name": "t"}}, "tokenSecretRef only applies to hf://"),
    ({"source": "hf://org/m", "credentialsSecret": "c"}, "credentialsSecret only applies to s3://"),
    ({"source": "embedded", "endpoint": "http://mirror"}, "endpoint only applies to hf:// and s3://")])
def test_source_settings_only_where_they_apply(model: dict, message: str) -> None:
    from kubeinfer.operator.crd import crd
    rules = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert any(message in r["message"] for r in rules["x-kubernetes-validations"])


@pytest.mark.parametrize("engine", [{"tensorParallelSize": 0}, {"tensorParallelSize": 16},
                                    {"blockSize": 12}, {"maxNumSeqs": -1}, {"kvCacheDtype": "int8"}])
def test_engine_bounds(engine: dict) -> None:
    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate({"engine": engine})


def test_quantities_are_checked() -> None:
    with pytest.raises(ValidationError, match="quantity"):
        InferenceServiceSpec.model_validate({"resources": {"memory": "lots"}})
