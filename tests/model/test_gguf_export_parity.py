"""Tiny models written as GGUF the way llama.cpp does load to the same logits as transformers:
a Llama (GQA q/k permutation, untied output, Llama-3 rope scaling as `rope_freqs`) and a Qwen2
(q/k/v biases, no permutation), with Q8_0 matrices."""

from __future__ import annotations

import torch
import pytest

from helpers.gguf_export import export_gguf
from helpers.paged import PagedRunner
from helpers.tiny_models import build_tiny_llama, build_tiny_qwen2

from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12, 64, 65, 66, 1, 120, 121, 122, 200, 201, 3, 44, 45]


def test_llama_gguf_matches_transformers(tmp_path):
    path, hf_model = build_tiny_llama(tmp_path, rope_scaling=LLAMA3_ROPE, num_kv_heads=2)
    reference_model = export_gguf(path, hf_model, tmp_path / "tiny.Q8_0.gguf")
    loaded = load_model(str(tmp_path / "tiny.Q8_0.gguf"), dtype="float32", device="cpu")
    assert loaded.name == "tiny" and loaded.config.rope_scaling == {"rope_type": "freq_factors"}
    assert not loaded.config.tie_word_embeddings and loaded.config.num_key_value_heads == 2
    with torch.no_grad():
        reference = reference_model(torch.tensor([PROMPT])).logits[0]
    logits = PagedRunner(loaded.model).step([("a", PROMPT)], all_logits=True)
    # float32 both sides; the only difference is rope frequencies recovered from the stored ratios (1 ulp)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert loaded.tokenizer.encode("Hello, world!") == loaded.tokenizer.encode("Hello, world!", False)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo 🌍")) == "héllo 🌍"


def test_qwen2_gguf_matches_transformers(tmp_path):
    path, hf_model = build_tiny_qwen2(tmp_path)
    reference_model = export_gguf(path, hf_model, tmp_path / "tiny-qwen2-Q8_0.gguf")
    loaded = load_model(str(tmp_path / "tiny-qwen2-Q8_0.gguf"), dtype="float32", device="cpu")
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias and loaded.name == "tiny-qwen2"
    with torch.no_grad():
        reference = reference_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(loaded.model).step([("a", PROMPT)], all_logits=True), reference,
                               atol=1e-4, rtol=0)
