"""Logits parity with transformers on tiny random HF checkpoints, through the paged cache.

Tolerances: float32 max |logit diff| <= 1e-4 (the runs differ only in op order: fused q/k/v and
gate/up GEMMs, SDPA instead of eager attention; measured 0 one-shot and ~2e-6 chunked, on logits
of std ~0.8). bfloat16
(our bf16 model vs transformers' bf16 model): <= 0.1 absolute and identical argmax on >= 90% of
positions (bf16 keeps 8 mantissa bits; measured max diffs 0.023-0.033, argmax agreement 95-100% on
these random models, whose top logits are often near-ties).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.paged import PagedRunner
from helpers.tiny_models import build_tiny_llama, build_tiny_mistral, build_tiny_qwen2

from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

FP32_ATOL = 1e-4
PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12, 64, 65, 66, 1, 120, 121, 122, 200, 201, 3, 44, 45]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _check_prefill_chunks_and_decode(path, hf_model, dtype="float32", atol=FP32_ATOL):
    model = load_model(str(path), dtype=dtype, device="cpu").model
    decoded = PROMPT + [11, 250, 38]
    reference = _reference(hf_model, decoded)
    one_shot = PagedRunner(model).step([("a", PROMPT)], all_logits=True)
    torch.testing.assert_close(one_shot, reference[:len(PROMPT)], atol=atol, rtol=0)
    runner = PagedRunner(model)   # 3 chunks over the cached prefix, then 3 decode steps
    chunks = [runner.step([("a", PROMPT[:5])], all_logits=True), runner.step([("a", PROMPT[5:13])], all_logits=True),
              runner.step([("a", PROMPT[13:])], all_logits=True)]
    chunks += [runner.step([("a", [token])]) for token in decoded[len(PROMPT):]]
    torch.testing.assert_close(torch.cat(chunks), reference, atol=atol, rtol=0)


def test_qwen2_with_bias_and_gqa(tmp_path):
    _check_prefill_chunks_and_decode(*build_tiny_qwen2(tmp_path, num_kv_heads=2))


def test_llama_with_tied_embeddings(tmp_path):
    path, hf_model = build_tiny_llama(tmp_path, tie_word_embeddings=True, num_kv_heads=1)
    assert not any(name.startswith("lm_head") for name in load_model(str(path), "float32", "cpu").model.state_dict())
    _check_prefill_chunks_and_decode(path, hf_model)


def test_llama3_rope_scaling_from_classic_config_keys(tmp_path):
    """Hub checkpoints spell rope as `rope_theta` + `rope_scaling` (transformers 5 writes `rope_parameters`)."""
    path, hf_model = build_tiny_llama(tmp_path, rope_scaling=LLAMA3_ROPE)
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    assert load_model(str(path), "float32", "cpu").config.rope_scaling["rope_type"] == "llama3"
    _check_prefill_chunks_and_decode(path, hf_model)


def test_mistral_sliding_window(tmp_path):
    """A window of 8 over a 25-token sequence: both the prefill and the chunked/decode paths must mask."""
    path, hf_model = build_tiny_mistral(tmp_path, sliding_window=8)
    assert load_model(str(path), "float32", "cpu").config.sliding_window == 8
    _check_prefill_chunks_and_decode(path, hf_model)


def test_bfloat16_tracks_transformers_bfloat16(tmp_path):
    path, hf_model = build_tiny_qwen2(tmp_path)
    reference = _reference(hf_model.to(torch.bfloat16), PROMPT)
    logits = PagedRunner(load_model(str(path), "bfloat16", "cpu").model).step([("a", PROMPT)], all_logits=True)
    assert (logits - reference).abs().max().item() <= 0.1
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


def test_ragged_batch_equals_sequences_alone(tmp_path):
    """2 prefills of different lengths + 2 decodes in ONE step give each sequence's solo logits."""
    model = load_model(str(build_tiny_llama(tmp_path)[0]), "float32", "cpu").model
    runner = PagedRunner(model, num_blocks=96)
    runner.step([("d1", PROMPT[:9])])
    runner.step([("d2", PROMPT[4:19])])
    mixed = runner.step([("p1", PROMPT[:13]), ("d1", [40]), ("p2", PROMPT[2:7]), ("d2", [41])], all_logits=True)
    solo = {}
    for seq_id, history, new in [("p1", [], PROMPT[:13]), ("d1", PROMPT[:9], [40]), ("p2", [], PROMPT[2:7]),
                                 ("d2", PROMPT[4:19], [41])]:
        alone = PagedRunner(model, seed=7)
        if history:
            alone.step([(seq_id, history)])
        solo[seq_id] = alone.step([(seq_id, new)], all_logits=True)
    expected = torch.cat([solo["p1"], solo["d1"], solo["p2"], solo["d2"]])
    torch.testing.assert_close(mixed, expected, atol=1e-5, rtol=0)


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_tiny_llama(tmp_path)[0]
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights: model.layers.1.self_attn.qkv_proj.weight#1"):
        load_model(str(path), "float32", "cpu")
