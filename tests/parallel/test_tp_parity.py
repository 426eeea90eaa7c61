"""On the CPU with gloo, tensor-parallel greedy output equals TP=1 token for token, logits within tolerance."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import (make_tiny_gemma2, make_tiny_gemma3, make_tiny_llama, make_tiny_mixtral, make_tiny_phi3,
                                 make_tiny_qwen2, make_tiny_qwen3, make_tiny_qwen3_moe)
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from parity import assert_greedy_parity

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
TINY_TOL = dict(tie_gap=1e-3, logprob=1e-4)     # float32, 2 layers
SMOL_TOL = dict(tie_gap=5e-3, logprob=5e-3)     # float32, 30 layers
# Small chunks so prefill is chunked over a cached prefix, and several sequences decode together.
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20)


def random_prompts(count: int, seed: int, vocab: int = 384) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 40, (count,), generator=generator)]


@pytest.mark.parametrize("build, kv_heads, tied", [
    pytest.param(make_tiny_llama, 2, False, id="llama-kv2-untied"),
    pytest.param(make_tiny_qwen2, 1, True, id="qwen2-bias-kv1-replicated-tied"),
    pytest.param(make_tiny_qwen3, 2, False, id="qwen3-qk-norm"),
    pytest.param(make_tiny_mixtral, 2, False, id="mixtral-experts-sharded"),
    pytest.param(make_tiny_qwen3_moe, 1, True, id="qwen3-moe-experts-and-dense-sharded-kv1-tied"),
    pytest.param(make_tiny_gemma2, 2, True, id="gemma2-window-softcaps"),
    pytest.param(make_tiny_gemma3, 1, False, id="gemma3-window-qk-norm-kv1-untied"),
    pytest.param(make_tiny_phi3, 2, False, id="phi3-fused-weights-split-then-sharded"),
])
def test_tiny_model_tp2_matches_tp1(build, kv_heads, tied, tmp_path, make_tp_llm):
    path = str(build(tmp_path, num_kv_heads=kv_heads, tie_word_embeddings=tied))
    prompts = random_prompts(4, seed=kv_heads)
    reference = LLM(path, **ENGINE).generate(prompts, GREEDY)
    outputs = make_tp_llm(path, tensor_parallel_size=2, **ENGINE).generate(prompts, GREEDY)
    assert_greedy_parity(outputs, reference, **TINY_TOL)


def test_embedded_model_tp3_matches_tp1(make_tp_llm):
    """SmolLM2 (9 heads, 3 KV heads, Q4_1 GGUF): sharded dequantization and the q/k un-permutation hold."""
    engine = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, kv_cache_memory=16 << 20)
    reference_llm = LLM("embedded", **engine)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prompts = [reference_llm.tokenizer.encode(chat.format(q), add_special_tokens=False)
               for q in ("What is the capital of France?", "Name three colours.")]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    reference = reference_llm.generate(prompts, params)
    del reference_llm
    outputs = make_tp_llm("embedded", tensor_parallel_size=3, **engine).generate(prompts, params)
    assert_greedy_parity(outputs, reference, **SMOL_TOL)
