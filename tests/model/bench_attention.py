"""Benchmark the torch attention backend on SmolLM2 shapes (9 heads, 3 KV heads, head_dim 64).

    python tests/model/bench_attention.py [--threads N]

Cases: 32 decodes over 256-token contexts; a lone 512-token prefill (causal fast path); a mixed
step (2 prefill chunks of 128 over 128 cached tokens + 30 decodes). For the decode case it also
times the alternatives we rejected, so the choice stays measurable: advanced-indexing gather
instead of `index_select`, and K/V expanded to all heads instead of `enable_gqa`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for `helpers` when run as a script
from helpers.paged import scattered_batch  # noqa: E402

from kubeinfer.server.model.forward_batch import ForwardBatch  # noqa: E402
from kubeinfer.server.model.layers.attention import TorchAttention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 9, 3, 64, 16, 2048


def make_batch(seqs: list[tuple[int, int]]) -> ForwardBatch:
    return scattered_batch(seqs, block_size=BLOCK, num_blocks=NUM_BLOCKS)[0]


def timed(fn, repeat: int = 20) -> float:
    """Median milliseconds per call (median: the machine is shared)."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def bench_case(name: str, seqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    batch = make_batch(seqs)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch.num_tokens, HEADS, HEAD_DIM, dtype=dtype)
    k = torch.randn(batch.num_tokens, KV_HEADS, HEAD_DIM, dtype=dtype)
    v = torch.randn_like(k)
    # a fresh backend per call: the per-step layout is rebuilt, as on a real step's first layer
    ms = timed(lambda: TorchAttention().forward(q, k, v, k_cache, v_cache, batch, HEAD_DIM ** -0.5))
    backend = TorchAttention()
    layer_ms = timed(lambda: backend.forward(q, k, v, k_cache, v_cache, batch, HEAD_DIM ** -0.5))
    print(f"{name:<34} {str(dtype):<15} first layer {ms:7.2f} ms   other layers {layer_ms:7.2f} ms")


def bench_decode_alternatives(dtype: torch.dtype, num_seqs: int = 32, context: int = 256) -> None:
    blocks = torch.randperm(NUM_BLOCKS)[: num_seqs * context // BLOCK].view(num_seqs, -1)
    cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    q = torch.randn(num_seqs, HEADS, 1, HEAD_DIM, dtype=dtype)
    mask = torch.ones(num_seqs, 1, 1, context, dtype=torch.bool)
    flat = blocks.reshape(-1)

    def gather_index_select():
        return cache.index_select(0, flat).view(num_seqs, context, KV_HEADS, HEAD_DIM).transpose(1, 2)

    def gather_advanced():
        return cache[blocks].view(num_seqs, context, KV_HEADS, HEAD_DIM).transpose(1, 2)

    def sdpa_gqa():
        kv = gather_index_select()
        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)

    def sdpa_expanded():
        kv = gather_index_select().repeat_interleave(HEADS // KV_HEADS, dim=1)
        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)

    print(f"decode alternatives {str(dtype):<15} gather: index_select {timed(gather_index_select):.2f} ms, "
          f"advanced indexing {timed(gather_advanced):.2f} ms | attention: enable_gqa {timed(sdpa_gqa):.2f} ms, "
          f"expanded K/V {timed(sdpa_expanded):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    for dtype in (torch.float32, torch.bfloat16):
        bench_case("32 decodes, 256-token contexts", [(255, 1)] * 32, dtype)
        bench_case("1 prefill of 512 (causal fast path)", [(0, 512)], dtype)
        bench_case("2x128 chunks on 128 cached + 30 dec", [(128, 128)] * 2 + [(200, 1)] * 30, dtype)
        bench_decode_alternatives(dtype)


if __name__ == "__main__":
    main()
