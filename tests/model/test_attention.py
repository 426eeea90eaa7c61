"""The torch attention backend against a naive per-sequence reference over the same paged cache."""

from __future__ import annotations

import pytest
import torch
from helpers.paged import scattered_batch

from kubeinfer.kernels.cpu import paged_prefill_cpu
from kubeinfer.server.model.layers.attention import TorchAttention, _similar_query_lengths, get_attention_backend

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 6, 2, 8, 4, 48


def _batch(seqs: list[tuple[int, int]], skip_rows: frozenset[int] = frozenset()):
    return scattered_batch(seqs, block_size=BLOCK, num_blocks=NUM_BLOCKS, skip_rows=skip_rows)


def _reference(q, k_cache, v_cache, seqs, tables, scale):
    """Per sequence, per query: softmax over the visible keys read slot by slot."""
    out, row = [], 0
    for (cached, new), table in zip(seqs, tables):
        for i in range(new):
            visible = cached + i + 1
            slot_ids = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(visible)]
            keys = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slot_ids].repeat_interleave(HEADS // KV_HEADS, 1)
            values = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slot_ids].repeat_interleave(HEADS // KV_HEADS, 1)
            weights = torch.einsum("hd,khd->hk", q[row], keys).mul(scale).softmax(-1)
            out.append(torch.einsum("hk,khd->hd", weights, values))
            row += 1
    return torch.stack(out)


def _caches():
    generator = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


@pytest.mark.parametrize("seqs", [
    [(0, 11)],                               # lone prefill, no prefix: causal over its own k/v
    [(9, 1), (0, 1), (30, 1), (4, 1)],        # decode-only
    [(0, 7), (13, 1), (5, 6), (22, 1)],       # prefills, a chunk after a cached prefix, decodes
    [(17, 5)],                               # one chunk on top of a cached prefix
    [(13, 1), (22, 1), (0, 9)],              # the scheduler's order: decodes, then a fresh prefill
    [(13, 1), (3, 4), (20, 6)],              # decodes, then chunks padded apart from them
    [(3, 4), (13, 1), (20, 6), (40, 1)],     # decodes between chunks: rows are not contiguous
    [(0, 7), (0, 12), (13, 1), (0, 3)],      # fresh prefills, each causal on its own, and a decode
    [(0, 5), (0, 5), (0, 5), (0, 9), (0, 5), (13, 1)],   # adjacent equal prefills share one SDPA call
    [(0, 6), (0, 6)],                        # only fresh prefills of one length
    [(16, 2), (30, 12), (8, 2), (5, 1), (24, 2)],   # short chunks and a long one: padded apart
])
@pytest.mark.parametrize("decode_kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_matches_reference_and_stores_kv(seqs, decode_kernel):
    batch, tables = _batch(seqs)
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
    k_cache, v_cache = _caches()
    out = TorchAttention(decode_kernel=decode_kernel).forward(q, k, v, k_cache, v_cache, batch,
                                                              HEAD_DIM ** -0.5)
    assert torch.equal(k_cache.view(-1, KV_HEADS, HEAD_DIM)[batch.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, KV_HEADS, HEAD_DIM)[batch.slot_mapping], v)
    expected = _reference(q, k_cache, v_cache, seqs, tables, HEAD_DIM ** -0.5)
    assert out.shape == (batch.num_tokens, HEADS, HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_skipped_slots_are_not_written():
    seqs = [(0, 3), (6, 1)]
    batch, _ = _batch(seqs, skip_rows={1})
    k_cache, v_cache = _caches()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM)
    k = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM)
    TorchAttention().forward(q, k, k.clone(), k_cache, v_cache, batch, 1.0)
    written = batch.slot_mapping[batch.slot_mapping >= 0]
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[written] = False
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):
        rows = NUM_BLOCKS * BLOCK
        assert torch.equal(cache.view(rows, -1)[untouched], before.view(rows, -1)[untouched])
    assert torch.equal(k_cache.view(-1, KV_HEADS, HEAD_DIM)[written], k[[0, 2, 3]])


def test_cpu_device_gets_the_torch_backend():
    assert isinstance(get_attention_backend(torch.device("cpu")), TorchAttention)


def test_decodes_take_the_torch_path_while_the_kernel_compiles(monkeypatch):
    """A starting server does not wait for gcc: steps taken while `start_building` still compiles
    the decode kernel attend in torch, and the first step after it is done uses the kernel."""
    from kubeinfer.kernels.cpu import paged_decode_cpu

    if not paged_decode_cpu.available(torch.float32):
        pytest.skip("the CPU decode kernel does not build here")
    seqs = [(9, 1), (30, 1), (4, 1)]
    compiling, kernel_calls = True, []
    real_kernel = paged_decode_cpu.paged_decode

    def spy(*args, **kwargs):
        kernel_calls.append(1)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(paged_decode_cpu, "building", lambda: compiling)
    monkeypatch.setattr(paged_decode_cpu, "paged_decode", spy)
    attention = TorchAttention()
    for step in range(3):
        compiling = step < 2
        batch, tables = _batch(seqs)   # a new ForwardBatch per step, as the engine builds them
        q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM)
        k = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = _caches()
        out = attention.forward(q, k, k.clone(), k_cache, v_cache, batch, HEAD_DIM ** -0.5)
        torch.testing.assert_close(out, _reference(q, k_cache, v_cache, seqs, tables, HEAD_DIM ** -0.5),
                                   atol=1e-5, rtol=1e-5)
        assert len(kernel_calls) == (0 if compiling else 1), f"step {step}"


def test_chunks_are_padded_only_with_chunks_of_similar_length():
    """Fifteen 32-token chunks and a 200-token one: two SDPA calls, not 16 x 200 queries."""
    assert _similar_query_lengths([0, 1, 2, 3, 4], [2, 12, 2, 1, 2]) == [[0, 2, 3, 4], [1]]
    lengths = [32] * 7 + [200] + [32] * 8
    assert _similar_query_lengths(list(range(16)), lengths) == [[i for i in range(16) if i != 7], [7]]
    assert _similar_query_lengths([0, 1, 2], [1, 1, 1]) == [[0, 1, 2]]


@pytest.mark.parametrize("seqs", [
    [(0, 11)],                                       # a fresh prompt
    [(0, 7), (13, 1), (5, 6), (22, 1)],              # prompts, a chunk after a prefix, decodes
    [(16, 2), (30, 12), (8, 2), (5, 1), (24, 2)],    # chunks of different lengths after prefixes
])
@pytest.mark.parametrize("decode_kernel", [False, True], ids=["decodes-in-prefill-kernel", "decode-kernel"])
def test_prefill_kernel_matches_the_torch_path(seqs, decode_kernel, monkeypatch):
    """bf16 with head_dim 64 (what the CPU prefill kernel takes): the same outputs as the torch
    path on the same values in float32, and every multi-query sequence goes through the kernel."""
    if not paged_prefill_cpu.available(torch.bfloat16, 64):
        pytest.skip("the CPU prefill kernel needs AMX or AVX512-BF16")
    calls = []
    real_kernel = paged_prefill_cpu.paged_prefill
    monkeypatch.setattr(paged_prefill_cpu, "paged_prefill",
                        lambda q, *args: calls.append(q.shape[0]) or real_kernel(q, *args))
    batch, _ = _batch(seqs)
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim = 9, 3, 64
    q, k, v = (torch.randn(batch.num_tokens, n, head_dim, generator=generator).to(torch.bfloat16)
               for n in (heads, kv_heads, kv_heads))
    caches = [torch.randn(NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
              for _ in range(2)]
    got = TorchAttention(decode_kernel=decode_kernel, prefill_kernel=True).forward(
        q, k, v, caches[0].clone(), caches[1].clone(), batch, head_dim ** -0.5)
    want = TorchAttention(decode_kernel=False, prefill_kernel=False).forward(
        q.float(), k.float(), v.float(), caches[0].float(), caches[1].float(), batch, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    multi_query_rows = sum(new for _, new in seqs if new > 1 or not decode_kernel)
    assert calls == [multi_query_rows]
