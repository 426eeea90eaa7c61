"""Every model family added through the registry against transformers on a tiny random-weight model
built from transformers' own config class (the family's distinctive options on), in float32:

- prefill logits, then the same prompt in three chunks over the paged cache followed by 32
  teacher-forced decode steps, every position against one transformers forward over the whole
  sequence;
- one step mixing a prefix-cache hit (a sequence started on another's cached blocks), a decode
  and a fresh prefill of another length, each row against that sequence's own reference;
- the engine end to end (chunked prefill, prefix caching, sequences of different lengths decoding
  together): greedy tokens and their logprobs equal transformers' greedy generation;
- where llama.cpp's converter defines the family, a GGUF written by the test (Q8_0) loads to the
  logits of the transformers model holding the same quantized weights.

Tolerance: max |logit diff| <= 1e-4 (float32; the runs differ in op order only: merged GEMMs,
SDPA instead of eager attention, the cached prefix read in another order; logits std ~1).
"""

from __future__ import annotations

import functools
from typing import Callable

import pytest
import torch
from helpers.gguf_export import export_gguf
from helpers.paged import PagedRunner, assert_stepwise_parity
from helpers.tiny_models import (build_tiny_gemma2, build_tiny_gemma3, build_tiny_mixtral, build_tiny_phi3,
                                 build_tiny_qwen3, build_tiny_qwen3_moe)

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

FP32_ATOL = 1e-4
PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12, 64, 65, 66, 1, 120, 121, 122, 200, 201, 3, 44, 45]
DECODE_STEPS = 32

# family id -> builder(tmp_path) -> (HF directory, transformers model)
FAMILIES: dict[str, Callable] = {
    "qwen3": build_tiny_qwen3,
    # YaRN over an original context of 16 positions, shorter than every test sequence
    "qwen3_yarn": functools.partial(build_tiny_qwen3, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "mixtral": build_tiny_mixtral,
    "qwen3_moe": build_tiny_qwen3_moe,
    "gemma2": build_tiny_gemma2,
    "gemma3_text": build_tiny_gemma3,
    "phi3": build_tiny_phi3,
}
# those `helpers.gguf_export` writes in llama.cpp's layout -> llama.cpp's architecture name
GGUF_FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family id, HF directory, transformers model, our float32 model loaded from the directory)."""
    path, hf_model = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, path, hf_model, load_model(str(path), dtype="float32", device="cpu").model


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _continuation(seed: int) -> list[int]:
    return torch.randint(3, 384, (DECODE_STEPS,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_chunks_and_32_decode_steps(family):
    _, _, hf_model, model = family
    sequence = PROMPT + _continuation(0)
    reference = _reference(hf_model, sequence)
    one_shot = PagedRunner(model, num_blocks=32).step([("a", PROMPT)], all_logits=True)
    torch.testing.assert_close(one_shot, reference[:len(PROMPT)], atol=FP32_ATOL, rtol=0)
    runner = PagedRunner(model, num_blocks=32)
    steps = [runner.step([("a", PROMPT[:5])], all_logits=True), runner.step([("a", PROMPT[5:13])], all_logits=True),
             runner.step([("a", PROMPT[13:])], all_logits=True)]
    steps += [runner.step([("a", [token])]) for token in sequence[len(PROMPT):-1]]
    torch.testing.assert_close(torch.cat(steps), reference[:-1], atol=FP32_ATOL, rtol=0)


def test_prefix_hit_decode_and_prefill_in_one_step(family):
    _, _, hf_model, model = family
    shared = PROMPT[:16]
    hit, fresh = shared + [77, 78, 79, 80, 81], [9, 8, 7, 6, 5, 4, 3]
    runner = PagedRunner(model, num_blocks=48)
    runner.step([("a", PROMPT)])
    runner.share_prefix("a", "b", len(shared))
    mixed = runner.step([("b", hit[len(shared):]), ("a", [40]), ("c", fresh)], all_logits=True)
    expected = torch.cat([_reference(hf_model, hit)[len(shared):], _reference(hf_model, PROMPT + [40])[-1:],
                          _reference(hf_model, fresh)])
    torch.testing.assert_close(mixed, expected, atol=FP32_ATOL, rtol=0)


def test_bfloat16_tracks_transformers_bfloat16(family):
    """Our bf16 model (on CPU bf16: oneDNN-prepacked linears and experts) stays as close to the
    float32 reference as transformers' own bf16 model does (within 1.5x its error + 0.02; these
    random models' bf16 errors measured 0.07-0.35 for both), and picks its argmax on >= 90% of
    positions (near-ties move under bf16 rounding)."""
    import copy

    _, path, hf_model, _ = family
    reference = _reference(hf_model, PROMPT)
    hf_bf16 = _reference(copy.deepcopy(hf_model).to(torch.bfloat16), PROMPT)
    logits = PagedRunner(load_model(str(path), "bfloat16", "cpu").model).step([("a", PROMPT)], all_logits=True)
    assert (logits - reference).abs().max().item() <= 1.5 * (hf_bf16 - reference).abs().max().item() + 0.02
    assert (logits.argmax(-1) == hf_bf16.argmax(-1)).float().mean().item() >= 0.9


def test_engine_greedy_matches_transformers(family):
    """Chunked prefill (16-token steps), a shared 16-token prefix cached and hit, four lengths."""
    _, path, hf_model, _ = family
    prompts = [PROMPT, PROMPT[:16] + [7, 300, 12], PROMPT[:16] + [250] * 9, [64, 65, 66, 67, 68]]
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=4 << 20, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, logprobs=1, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    outputs = first + llm.generate(prompts[1:], params)
    assert sum(output.num_cached_tokens for output in outputs[1:]) >= 2 * 16
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = _hf_greedy(hf_model, prompt)
        ours = output.outputs[0]
        assert ours.token_ids == tokens
        ours_logprobs = torch.tensor([ours.logprobs[step][token].logprob for step, token in enumerate(tokens)])
        torch.testing.assert_close(ours_logprobs, logprobs, atol=FP32_ATOL, rtol=0)


def _hf_greedy(hf_model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and their logprobs (EOS not special: the engine ignores it too)."""
    tokens, logprobs = [], []
    for _ in range(DECODE_STEPS):
        row = _reference(hf_model, prompt + tokens)[-1].log_softmax(-1)
        tokens.append(int(row.argmax()))
        logprobs.append(row[tokens[-1]])
    return tokens, torch.stack(logprobs)


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_gguf_matches_transformers(name, tmp_path):
    path, hf_model = FAMILIES[name](tmp_path)
    reference_model = export_gguf(path, hf_model, tmp_path / f"tiny-{name}.Q8_0.gguf")
    loaded = load_model(str(tmp_path / f"tiny-{name}.Q8_0.gguf"), dtype="float32", device="cpu")
    assert loaded.config.architecture == GGUF_FAMILIES[name]
    assert (loaded.config.moe is not None) == (name != "qwen3")
    sequence = PROMPT + _continuation(1)[:8]
    reference = _reference(reference_model, sequence)
    runner = PagedRunner(loaded.model, num_blocks=32)
    steps = [runner.step([("a", PROMPT[:9])], all_logits=True), runner.step([("a", PROMPT[9:])], all_logits=True)]
    steps += [runner.step([("a", [token])]) for token in sequence[len(PROMPT):-1]]
    torch.testing.assert_close(torch.cat(steps), reference[:-1], atol=FP32_ATOL, rtol=0)


def test_moe_config_from_transformers_keys():
    from kubeinfer.server.model.config import ModelConfig

    base = dict(model_type="qwen3_moe", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    moe = ModelConfig.from_hf({**base, "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (8, 2, 32, False)
    assert moe.dense_layers == {0, 2, 3}   # sparse every 2nd layer, layer 3 forced dense
    mixtral = ModelConfig.from_hf({**base, "model_type": "mixtral", "num_experts": None, "num_local_experts": 4,
                                   "moe_intermediate_size": None}).moe
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.renormalize, mixtral.dense_layers) == \
        (4, 128, True, frozenset())
    with pytest.raises(ValueError, match="shared experts"):
        ModelConfig.from_hf({**base, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="mix sliding-window and full-attention"):
        ModelConfig.from_hf({**base, "model_type": "qwen3", "num_experts": 0, "use_sliding_window": True})


@pytest.mark.parametrize("change, message", [
    pytest.param({"model_type": "gemma3"}, r"unsupported architecture 'gemma3'; supported: .*qwen3_moe.*gemma3_text",
                 id="multimodal-gemma3"),
    pytest.param({"model_type": "gpt_oss"}, r"unsupported architecture 'gpt_oss'; supported: llama, mistral", id="gpt-oss"),
    pytest.param({"model_type": "llama", "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
                 "llama: models that mix sliding-window and full-attention layers are not supported", id="llama-mixed"),
    pytest.param({"model_type": "gemma2", "hidden_activation": "relu"}, "hidden activation 'relu' is not supported",
                 id="gemma-activation"),
    pytest.param({"model_type": "phi3", "partial_rotary_factor": 0.75},
                 r"partial rotary embeddings \(partial_rotary_factor 0.75\) are not supported", id="phi4-mini-rotary"),
    pytest.param({"rope_parameters": {"rope_type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1e6}},
                 "unsupported rope scaling type 'mrope'; supported: default", id="rope-type"),
])
def test_unsupported_architecture_or_feature_is_refused_at_load(change, message, tmp_path):
    """Never garbage output: what the engine cannot run is refused by name, with what it can."""
    import json

    path = build_tiny_qwen3(tmp_path)[0]
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        load_model(str(path), dtype="float32", device="cpu")


def test_longrope_switches_to_the_long_factors_past_the_original_context(tmp_path):
    """Phi-3.5-style LongRoPE over an original context of 16: a sequence rotates with the short
    factors while within 16 positions and with the long ones (and the attention factor) in the
    steps that take it past, as transformers' generate does, step for step through its cache:
    a 12-token prefill, decode steps that cross 16, and a 30-token prefill that starts past it."""
    half = 8   # head_dim 16
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    path, hf_model = build_tiny_phi3(tmp_path, sliding_window=None, rope_scaling=rope)
    model = load_model(str(path), dtype="float32", device="cpu").model
    for prompt, steps in ((PROMPT[:12], 8), ((PROMPT * 2)[:30], 3)):
        assert_stepwise_parity(model, hf_model, prompt, _continuation(2)[:steps], atol=FP32_ATOL)
