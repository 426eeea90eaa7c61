"""`spec.engine.speculative` → the engine's --speculative-config: rendered through the shared
flag table, the draft model's claim mounted, bad specs refused with clear messages (pydantic and
the CRD's enum and CEL rules)."""

from __future__ import annotations

import json

import pytest
from isvc_builders import CONFIG, make_isvc
from pydantic import ValidationError
from test_build import engine, parsed_args
from test_crd import schema

from kubeinfer.operator.build import deployment
from kubeinfer.operator.spec import InferenceServiceSpec
from kubeinfer.server.engine.spec_decode.config import SpeculativeConfig

pytestmark = pytest.mark.unit


def test_ngram_is_rendered_as_the_engines_json_flag() -> None:
    container = engine({"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 3,
                                                   "promptLookupMin": 2, "promptLookupMax": 4}}})
    flag = container["args"][container["args"].index("--speculative-config") + 1]
    assert json.loads(flag)["method"] == "ngram"
    assert parsed_args(container).speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    assert "--speculative-config" not in engine({})["args"]


def test_a_draft_model_on_another_claim_is_mounted_and_named() -> None:
    isvc = make_isvc({"model": {"source": "pvc://weights/llama-8b"},
                      "engine": {"speculative": {"method": "draft_model", "draftModel": "pvc://drafts/llama-1b",
                                                 "numSpeculativeTokens": 5, "disableByBatchSize": 8}}})
    pod = deployment(isvc, CONFIG)["spec"]["template"]["spec"]
    config = parsed_args(pod["containers"][0]).speculative_config
    assert (config.method, config.num_speculative_tokens, config.disable_by_batch_size) == ("draft_model", 5, 8)
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if config.model.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"] == {"claimName": "drafts", "readOnly": True} and mount["readOnly"]
    same_claim = make_isvc({"model": {"source": "pvc://weights/llama-8b"},
                            "engine": {"speculative": {"method": "draft_model", "draftModel": "pvc://weights/llama-1b"}}})
    container = deployment(same_claim, CONFIG)["spec"]["template"]["spec"]["containers"][0]
    assert parsed_args(container).speculative_config.model == "/models/llama-1b"


@pytest.mark.parametrize("speculative, message", [
    ({"method": "eagle"}, "Input should be 'ngram', 'suffix' or 'draft_model'"),
    ({"method": "draft_model"}, "draftModel is required by method draft_model"),
    ({"method": "ngram", "draftModel": "pvc://d/m"}, "draftModel is required by method draft_model and applies to no other"),
    ({"method": "suffix", "promptLookupMax": 3}, "promptLookupMin/Max apply to method ngram only"),
    ({"method": "ngram", "promptLookupMin": 5, "promptLookupMax": 2}, "must not exceed promptLookupMax"),
    ({"method": "ngram", "numSpeculativeTokens": 0}, "greater than or equal to 1"),
    ({"method": "draft_model", "draftModel": "hf://org/small"}, "pvc://<claim>/<path>"),
])
def test_bad_speculative_specs_are_refused_clearly(speculative: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        InferenceServiceSpec.model_validate({"engine": {"speculative": speculative}})


def test_the_crd_refuses_the_same_with_its_enum_and_rules() -> None:
    speculative = schema()["properties"]["spec"]["properties"]["engine"]["properties"]["speculative"]
    assert speculative["properties"]["method"]["enum"] == ["ngram", "suffix", "draft_model"]   # "Unsupported value"
    assert speculative["required"] == ["method"]
    messages = [rule["message"] for rule in speculative["x-kubernetes-validations"]]
    assert messages == ["engine.speculative.draftModel is required by method draft_model and applies to no other method",
                        "engine.speculative.promptLookupMin/Max apply to method ngram only",
                        "engine.speculative.promptLookupMin must not exceed promptLookupMax"]
    draft = speculative["properties"]["draftModel"]
    assert draft["x-kubernetes-validations"][0]["message"] == "engine.speculative.draftModel must be 'pvc://<claim>/<path>'"
