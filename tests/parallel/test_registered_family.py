"""A family registered at run time is served like a built-in one, tensor parallelism included.

`helpers.toy_family` registers a Llama variant with a GELU MLP under its own architecture name
through `register_model` alone; nothing in the loader, the TP code or the scheduler names it.
At TP=1 its greedy output equals transformers' (its twin is transformers' Llama with
hidden_act="gelu"), the built-in Llama on the same weights differs (so the changed part is what
runs), and at TP=2 over gloo it matches TP=1.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.tiny_models import build_tiny_llama
from helpers.toy_family import ARCHITECTURE, TOY_FAMILY
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.model.registry import register_model
from parity import assert_greedy_parity

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20)
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8], [64, 65, 66, 67, 68, 69, 70, 71, 72]]


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    """(HF directory of the toy architecture, its transformers twin)."""
    register_model(ARCHITECTURE, TOY_FAMILY)
    path, hf_model = build_tiny_llama(tmp_path_factory.mktemp("toy"), hidden_act="gelu", name="tiny-toy")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": ARCHITECTURE,
                                                  "architectures": ["ToyGeluLlamaForCausalLM"]}))
    return path, hf_model


def hf_greedy(hf_model, prompt: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_registered_family_matches_its_transformers_twin(toy_model, tmp_path):
    path, hf_model = toy_model
    outputs = LLM(str(path), **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in PROMPTS]
    as_llama = tmp_path / "as-llama"
    as_llama.mkdir()
    for file in path.iterdir():
        (as_llama / file.name).write_bytes(file.read_bytes())
    (as_llama / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                      "model_type": "llama"}))
    silu = LLM(str(as_llama), **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in silu] != [o.outputs[0].token_ids for o in outputs]


def test_registered_family_tp2_matches_tp1(toy_model, make_tp_llm):
    path = str(toy_model[0])
    reference = LLM(path, **ENGINE).generate(PROMPTS, GREEDY)
    outputs = make_tp_llm(path, tensor_parallel_size=2, **ENGINE).generate(PROMPTS, GREEDY)
    assert_greedy_parity(outputs, reference, tie_gap=1e-3, logprob=1e-4)
