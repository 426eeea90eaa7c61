"""A tiny Llama decoding through `TritonAttention` (interpreted) yields the torch path's tokens.

Two sequences share every step: a full prefill next to a first prompt chunk, then a decode
next to the prompt's second chunk (prefill over a cached prefix), then decodes only. Blocks
come from a shuffled pool (`PagedRunner`), so block tables are never contiguous.
"""

import functools

import pytest
import torch
from helpers.paged import PagedRunner
from helpers.quantized_models import write_gptq
from helpers.tiny_models import (build_tiny_llama, make_tiny_gemma2, make_tiny_gemma3, make_tiny_llama, make_tiny_mixtral,
                                 make_tiny_phi3, make_tiny_qwen3_moe)

from kubeinfer.kernels import ops

from kubeinfer.server.model.layers.attention import TorchAttention
from kubeinfer.server.model.layers.attention_triton import TritonAttention
from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

PROMPTS = {"a": list(range(10, 17)), "b": list(range(40, 53))}   # 7 and 13 prompt tokens
SCHEDULE = [{"a": 7, "b": 6}, {"a": 1, "b": 7}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}]


def _greedy(model: torch.nn.Module) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Feed each sequence its scheduled number of pending tokens per step, prompt first, then
    its own greedy samples; returns the sampled tokens and every step's logits."""
    runner = PagedRunner(model, num_blocks=12, block_size=16)
    pending = {seq: list(prompt) for seq, prompt in PROMPTS.items()}
    generated: dict[str, list[int]] = {seq: [] for seq in PROMPTS}
    all_logits = []
    for step in SCHEDULE:
        chunks = [(seq, pending[seq][:count]) for seq, count in step.items()]
        for seq, count in step.items():
            del pending[seq][:count]
        logits = runner.step(chunks)
        all_logits.append(logits)
        for row, (seq, _) in enumerate(chunks):
            if not pending[seq]:   # prompt fully fed: this step's last row samples the next token
                generated[seq].append(int(logits[row].argmax()))
                pending[seq].append(generated[seq][-1])
    return generated, all_logits


def _assert_triton_decodes_as_torch(torch_model: torch.nn.Module, triton_model: torch.nn.Module) -> None:
    """The same tokens and (within fp32 rounding) logits with every op on Triton as on torch."""
    want_tokens, want_logits = _greedy(torch_model)
    with ops.use_backend("triton"):
        got_tokens, got_logits = _greedy(triton_model)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_tiny_llama_decodes_the_same_tokens_through_triton_attention(tmp_path):
    path = str(make_tiny_llama(tmp_path))
    torch_model = load_model(path, dtype="float32", device="cpu").model
    triton_model = load_model(path, dtype="float32", device="cpu").model
    for layer in triton_model.model.layers:
        layer.self_attn.backend = TritonAttention()
    assert isinstance(torch_model.model.layers[0].self_attn.backend, TorchAttention)
    want_tokens, want_logits = _greedy(torch_model)
    got_tokens, got_logits = _greedy(triton_model)
    assert got_tokens == want_tokens and [len(t) for t in got_tokens.values()] == [5, 4]
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("build", [
    pytest.param(make_tiny_gemma2, id="gemma2-window-8-and-softcaps"),
    pytest.param(make_tiny_gemma3, id="gemma3-local-global-rope"),
    pytest.param(make_tiny_mixtral, id="mixtral-moe-kernel"),
    pytest.param(make_tiny_qwen3_moe, id="qwen3-moe-kernel"),
    # sequence "b" (13 prompt tokens) passes the original 16 positions while decoding
    pytest.param(functools.partial(make_tiny_phi3, sliding_window=None, rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 16, "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)]}), id="phi3-longrope-table-halves"),
    # dynamic NTK over 16 trained positions: the step's own cos|sin rows once "b" passes them
    pytest.param(functools.partial(make_tiny_llama, rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                   max_position_embeddings=16), id="llama-dynamic-ntk-step-rows"),
])
def test_new_families_decode_the_same_tokens_on_every_triton_kernel(build, tmp_path):
    """Every op on its Triton kernel (attention with each layer's window and soft-cap, the MoE
    grouped GEMM, norms, rotary from the table, LongRoPE's long half included), interpreted,
    against the CPU path."""
    path = str(build(tmp_path))
    torch_model = load_model(path, dtype="float32", device="cpu").model
    triton_model = load_model(path, dtype="float32", device="cpu").model
    for layer in triton_model.model.layers:
        backend = layer.self_attn.backend
        layer.self_attn.backend = TritonAttention(backend.sliding_window, getattr(backend, "softcap", None))
    _assert_triton_decodes_as_torch(torch_model, triton_model)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_model_decodes_the_same_tokens_through_the_packed_gemm_kernel(bits, tmp_path):
    """A GPTQ checkpoint (act-order) with every op on Triton: its linears on the packed-integer
    GEMM (`kernels/triton/w4a16.py`, weights dequantized inside the kernel), against the CPU path."""
    path, hf_model = build_tiny_llama(tmp_path)
    quantized, _ = write_gptq(path, hf_model, tmp_path / "gptq", bits=bits, desc_act=True)
    torch_model = load_model(str(quantized), dtype="float32", device="cpu").model
    triton_model = load_model(str(quantized), dtype="float32", device="cpu").model
    for layer in triton_model.model.layers:
        layer.self_attn.backend = TritonAttention()
    _assert_triton_decodes_as_torch(torch_model, triton_model)
