"""Every Triton kernel compiled for the GPU against its torch reference, in bf16 and fp16 (the
interpreter runs fp32/fp16 only and its bf16 is garbage), then the models and the engine on CUDA
against the CPU path on the same weights.

Tolerances: the references compute in float32 from the same rounded inputs, and the kernels'
outputs, of order 1, are rounded to bf16 (2^-8 relative) or fp16 (2^-11) and pass through
bf16/fp16 intermediates (attention's probabilities before P.V): 3e-2 absolute for bf16, 6e-3 for
fp16.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.engine_runs import generate_tokens
from helpers.paged import PagedRunner
from helpers.quantized_models import write_gptq
from helpers.tiny_models import (build_tiny_llama, make_tiny_gemma2, make_tiny_gemma3, make_tiny_llama,
                                 make_tiny_mixtral, make_tiny_qwen2, make_tiny_qwen3_moe)

from kubeinfer.kernels.reference.attention_ref import paged_attention_ref
from kubeinfer.kernels.reference.kv_cache_ref import store_kv_cache_ref
from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

CUDA = torch.device("cuda")
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
ATOL = {torch.bfloat16: 3e-2, torch.float16: 6e-3}


def _paged(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
           dtype: torch.dtype, seed: int = 0):
    """q and K/V caches for sequences given as (cached, new) tokens, blocks scattered over the pool."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    blocks_needed = sum(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = blocks_needed + 7
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    width = max(len(t) for t in tables)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=CUDA).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=CUDA).to(dtype)
    total = sum(n for _, n in seqs)
    q = torch.randn(total, num_heads, head_dim, generator=gen, device=CUDA).to(dtype)
    tensor = lambda values, kind: torch.tensor(values, dtype=kind, device=CUDA)  # noqa: E731
    block_tables = tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    return (q, k_cache, v_cache, block_tables, tensor(starts, torch.int32),
            tensor([c + n for c, n in seqs], torch.int32))


# prefill from nothing, a chunk over a cached prefix, long and short decodes, one in a mixed step
MIXED = [(0, 300), (500, 64), (1000, 1), (17, 1), (0, 5)]
DECODE = [(4000, 1), (70, 1), (1500, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, window, softcap", [
    pytest.param(32, 8, 128, 16, None, None, id="llama3-gqa4-d128"),
    pytest.param(14, 2, 64, 16, None, None, id="qwen-gqa7-d64"),
    pytest.param(8, 8, 80, 32, None, None, id="mha-d80-padded"),
    pytest.param(16, 4, 96, 16, 128, 50.0, id="gemma2-window-softcap-d96"),
    pytest.param(8, 1, 256, 8, None, None, id="mqa-d256"),
])
@pytest.mark.parametrize("seqs", [pytest.param(MIXED, id="mixed"), pytest.param(DECODE, id="decode")])
def test_attention_matches_reference(heads, kv_heads, head_dim, block_size, window, softcap, seqs, dtype):
    from kubeinfer.kernels.triton.split_kv_attention import split_kv_attention
    from kubeinfer.kernels.triton.unified_attention import unified_attention

    q, k_cache, v_cache, tables, qsl, seq_lens = _paged(seqs, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, qsl, seq_lens, scale,
                               sliding_window=window, softcap=softcap)
    got = unified_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale,
                            max_query_len=max(n for _, n in seqs), sliding_window=window, softcap=softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=0)
    if max(n for _, n in seqs) == 1:
        split = split_kv_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale, num_splits=4,
                                   sliding_window=window, softcap=softcap)
        torch.testing.assert_close(split.float(), want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_store_is_bitwise_and_attention_reads_it(cache_dtype):
    from kubeinfer.kernels.triton.kv_cache import store_kv_cache
    from kubeinfer.kernels.triton.unified_attention import unified_attention

    gen = torch.Generator(device=CUDA).manual_seed(3)
    tokens, kv_heads, head_dim, block_size, num_blocks = 200, 8, 128, 16, 20
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=CUDA).to(torch.bfloat16) * 40
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=CUDA).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=CUDA)[:tokens]
    slots[::17] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    got_k, got_v, want_k, want_v = (torch.zeros(shape, device=CUDA).to(cache_dtype) for _ in range(4))
    store_kv_cache(k, v, got_k, got_v, slots, k_scale=0.05, v_scale=0.01)
    store_kv_cache_ref(k, v, want_k, want_v, slots, k_scale=0.05, v_scale=0.01)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        got, want = got.view(torch.uint8), want.view(torch.uint8)
        differ = (got != want).nonzero().tolist()
        assert not differ, (len(differ), [(got[tuple(i)].item(), want[tuple(i)].item()) for i in differ[:8]])

    q, _, _, tables, qsl, seq_lens = _paged([(90, 1), (0, 40)], 32, kv_heads, head_dim, block_size, torch.bfloat16)
    tables = tables.clamp(max=num_blocks - 1)
    want = paged_attention_ref(q.float(), got_k, got_v, tables, qsl, seq_lens, 0.1, k_scale=0.05, v_scale=0.01)
    got = unified_attention(q, got_k, got_v, tables, qsl, seq_lens, 0.1, max_query_len=40, k_scale=0.05,
                            v_scale=0.01)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_kernels_match_reference(dtype):
    from kubeinfer.kernels.reference.activation_ref import silu_and_mul_ref
    from kubeinfer.kernels.reference.rms_norm_ref import rms_norm_ref
    from kubeinfer.kernels.reference.rope_cache import build_rope_cache
    from kubeinfer.kernels.reference.rotary_ref import apply_rotary_ref
    from kubeinfer.kernels.triton.activation import silu_and_mul
    from kubeinfer.kernels.triton.kv_cache import store_kv_cache
    from kubeinfer.kernels.triton.rms_norm import rms_norm
    from kubeinfer.kernels.triton.rotary import apply_rotary

    gen = torch.Generator(device=CUDA).manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=CUDA).to(dtype)  # noqa: E731
    x, residual, weight = rand(333, 4096), rand(333, 4096), rand(4096)
    normed, summed = rms_norm(x, weight, 1e-5, residual)
    want_normed, want_summed = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6).float(), rms_norm_ref(x, weight, 1e-6).float(),
                               atol=ATOL[dtype], rtol=1e-2)

    gate_up = rand(257, 2 * 1408)
    torch.testing.assert_close(silu_and_mul(gate_up).float(), silu_and_mul_ref(gate_up).float(),
                               atol=ATOL[dtype], rtol=1e-2)

    table = build_rope_cache(64, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             device=CUDA)
    q, k = rand(97, 32, 128), rand(97, 8, 128)
    positions = torch.randint(0, 8192, (97,), generator=gen, device=CUDA)
    got_q, got_k = apply_rotary(q, k, positions, table)   # partial rotary: 64 of 128 dims
    want_q, want_k = apply_rotary_ref(q, k, positions, table)
    torch.testing.assert_close(got_q.float(), want_q.float(), atol=ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(got_k.float(), want_k.float(), atol=ATOL[dtype], rtol=1e-2)

    k_cache, v_cache = torch.zeros(2, 40, 16, 8, 128, dtype=dtype, device=CUDA)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(40 * 16, generator=gen, device=CUDA)[:97]
    slots[5] = -1
    store_kv_cache(got_k, q[:, :8], k_cache, v_cache, slots)
    store_kv_cache_ref(got_k, q[:, :8], want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_moe_grouped_gemm_matches_reference(tokens, dtype):
    from kubeinfer.kernels.reference.moe_ref import fused_moe_ref
    from kubeinfer.kernels.triton.moe import fused_moe

    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    experts, top_k, hidden, inter = 8, 2, 512, 384
    x = torch.randn(tokens, hidden, generator=gen, device=CUDA).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=CUDA) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=CUDA) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device=CUDA)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, group_size, bits", [(1, 4096, 4096, 128, 4), (16, 11008, 4096, 128, 4),
                                                        (77, 1000, 768, 32, 8), (300, 512, 1024, 1024, 4)])
def test_packed_integer_gemm_matches_reference(m, n, k, group_size, bits, dtype):
    from kubeinfer.kernels.reference.w4a16_ref import pack_rows, packed_matmul_ref
    from kubeinfer.kernels.triton.w4a16 import matmul

    gen = torch.Generator(device=CUDA).manual_seed(m)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, device=CUDA)
    groups = -(-k // group_size)
    scales = torch.rand(groups, n, generator=gen, device=CUDA) * 0.02 + 0.005
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen, device=CUDA).float()
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    packed = pack_rows(q, bits)
    want = packed_matmul_ref(x, packed, scales, zeros, group_size, bits)
    got = matmul(x, packed, scales, zeros, group_size, bits)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=2 * ATOL[dtype] * max(scale, 1.0) / 8, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_sgmv_matches_reference(dtype):
    from kubeinfer.kernels.reference.lora_ref import lora_shrink_expand_ref
    from kubeinfer.kernels.triton.lora import lora_shrink_expand

    gen = torch.Generator(device=CUDA).manual_seed(5)
    slots_count, rank, hidden, out_dim = 4, 16, 2048, 2560
    x = torch.randn(70, hidden, generator=gen, device=CUDA).to(dtype)
    a = (torch.randn(slots_count, rank, hidden, generator=gen, device=CUDA) * 0.05).to(dtype)
    b = (torch.randn(slots_count, out_dim, rank, generator=gen, device=CUDA) * 0.05).to(dtype)
    starts = torch.tensor([0, 1, 33, 34, 60, 70], dtype=torch.int32, device=CUDA)
    slots = torch.tensor([2, 0, -1, 3, 1], dtype=torch.int32, device=CUDA)
    base = torch.randn(70, out_dim, generator=gen, device=CUDA).to(dtype)
    got, want = base.clone(), base.clone().float()
    lora_shrink_expand(x, got, a, b, starts, slots, longest=32)
    lora_shrink_expand_ref(x.float(), want, a.float(), b.float(), starts, slots)
    torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=1e-2)


# --- models: every op on its kernel on the GPU against the CPU's torch path in float32 ---

STEPS = [{"a": 7, "b": 6}, {"a": 1, "b": 7}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}]
PROMPTS = {"a": list(range(10, 17)), "b": list(range(40, 53))}


def _teacher_forced_logits(model: torch.nn.Module, tokens: dict[str, list[int]]) -> list[torch.Tensor]:
    """Each step's last-token logits, feeding each sequence its scheduled share of `tokens`."""
    runner = PagedRunner(model, num_blocks=12, block_size=16)
    fed = {seq: 0 for seq in tokens}
    logits = []
    for step in STEPS:
        chunks = []
        for seq, count in step.items():
            chunks.append((seq, tokens[seq][fed[seq]:fed[seq] + count]))
            fed[seq] += count
        logits.append(runner.step(chunks).float().cpu())
    return logits


def _reference_tokens(path: str) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """The CPU fp32 model's greedy continuation under the STEPS schedule, and its logits."""
    model = load_model(path, dtype="float32", device="cpu").model
    runner = PagedRunner(model, num_blocks=12, block_size=16)
    pending = {seq: list(p) for seq, p in PROMPTS.items()}
    tokens = {seq: list(p) for seq, p in PROMPTS.items()}
    logits = []
    for step in STEPS:
        chunks = [(seq, pending[seq][:count]) for seq, count in step.items()]
        for seq, count in step.items():
            del pending[seq][:count]
        out = runner.step(chunks)
        logits.append(out)
        for row, (seq, _) in enumerate(chunks):
            if not pending[seq]:
                pending[seq].append(int(out[row].argmax()))
                tokens[seq].append(pending[seq][-1])
    return tokens, logits


@pytest.mark.parametrize("build", [make_tiny_llama, make_tiny_qwen2, make_tiny_gemma2, make_tiny_gemma3,
                                   make_tiny_mixtral, make_tiny_qwen3_moe])
def test_models_on_cuda_match_the_cpu_path(build, tmp_path):
    """fp32 on the GPU (Triton's dots run in TF32 there, torch's matmuls do not) within 1e-2 of
    the CPU; bf16 within 0.3 of logits of order 1 (the CPU's own bf16 path is up to 0.17 off
    its fp32 on these models: two layers of bf16 activations)."""
    path = str(build(tmp_path))
    tokens, want = _reference_tokens(path)
    for dtype, atol in (("float32", 1e-2), ("bfloat16", 3e-1)):
        model = load_model(path, dtype=dtype, device="cuda").model
        got = _teacher_forced_logits(model, tokens)
        for step, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda m: f"{dtype} step {step}: {m}")


def test_gptq_model_on_cuda_runs_the_packed_gemm(tmp_path):
    path, hf_model = build_tiny_llama(tmp_path)
    quantized, _ = write_gptq(path, hf_model, tmp_path / "gptq", bits=4, desc_act=True)
    tokens, want = _reference_tokens(str(quantized))
    model = load_model(str(quantized), dtype="float16", device="cuda").model
    for g, w in zip(_teacher_forced_logits(model, tokens), want):
        torch.testing.assert_close(g, w, atol=3e-2, rtol=0)


def test_engine_on_cuda_generates_the_cpu_engines_tokens(tmp_path):
    """The whole engine (scheduler, paged cache, prefix cache, sampling) on CUDA: greedy outputs
    of prompts sharing a prefix equal the CPU engine's, and every KV block comes back."""
    from kubeinfer.server.engine.config import EngineConfig
    from kubeinfer.server.engine.llm_engine import LLMEngine
    from kubeinfer.server.engine.sampling_params import SamplingParams

    path = str(make_tiny_llama(tmp_path))
    prefix = list(range(100, 140))
    prompts = [prefix + [7, 8, 9], prefix + [11], list(range(3, 60)), prefix + [7, 8, 9, 10, 12]]

    def generate(device: str) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model=path, device=device, dtype="float32", kv_cache_memory=8 << 20,
                                        max_num_batched_tokens=32))
        return generate_tokens(engine, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)), engine

    want, cpu_engine = generate("cpu")
    got, engine = generate("cuda")
    assert got == want
    stats = engine.stats()
    assert stats.prefix_cache_hits == cpu_engine.stats().prefix_cache_hits > 0
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total


def test_decode_cuda_graphs_replay_the_eager_steps(tmp_path, monkeypatch):
    """Decode steps replayed from the captured graphs (padded batch sizes, sequences finishing at
    different steps, prefill steps between replays) give the eager engine's tokens.

    Split-KV is pinned off: a graph splits decode for `max_model_len`, an eager step for its own
    longest context, and with Triton's TF32 dots the two summation orders flipped one near-tie
    token of 11 sequences on an H200 (token 22 of 29), while graphs against the CPU engine agreed
    (`test_engine_on_cuda_generates_the_cpu_engines_tokens`)."""
    from kubeinfer.kernels import ops
    from kubeinfer.server.engine.config import EngineConfig
    from kubeinfer.server.engine.llm_engine import LLMEngine
    from kubeinfer.server.engine.sampling_params import SamplingParams

    monkeypatch.setattr(ops, "MAX_SPLITS", 1)
    path = str(make_tiny_llama(tmp_path))
    prompts = [list(range(3 + i, 20 + 7 * i)) for i in range(11)]

    def generate(eager: bool) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", kv_cache_memory=16 << 20,
                                        max_num_seqs=6, enforce_eager=eager))
        lengths = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
        return generate_tokens(engine, prompts, lengths), engine

    want, eager = generate(True)
    got, graphed = generate(False)
    assert eager.runner.graphs is None and graphed.runner.graphs.sizes == [1, 2, 4, 6]
    assert got == want
    stats = graphed.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total
