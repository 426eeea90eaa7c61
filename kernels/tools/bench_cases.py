"""The workloads `kubeinfer bench-kernels` times: each kernel, its torch reference and, for
attention, a dense `scaled_dot_product_attention` baseline on pre-gathered K/V.

Each case also states the bytes it must move and the FLOPs it must do, so the report can
show achieved GB/s and TFLOP/s and the H100 roofline time the kernel should approach.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..reference.attention_ref import paged_attention_ref


@dataclass
class BenchCase:
    name: str
    shape: str
    runs: dict[str, Callable[[], object]]   # "triton" | "torch" | "sdpa" -> a zero-argument launch
    bytes_moved: int
    flops: int


def _paged(args: argparse.Namespace, batch: int, q_len: int, context: int) -> dict:
    """A batch of `batch` sequences with `q_len` new tokens each after `context` cached ones."""
    dev, dtype, bs = "cuda", getattr(torch, args.dtype), args.block_size
    seq_len = context + q_len
    blocks = -(-seq_len // bs)
    table = torch.randperm(batch * blocks, device=dev, dtype=torch.int64).view(batch, blocks).int()
    cache_shape = (batch * blocks, bs, args.num_kv_heads, args.head_dim)
    return dict(q=torch.randn(batch * q_len, args.num_heads, args.head_dim, device=dev, dtype=dtype),
                k_cache=torch.randn(cache_shape, device=dev, dtype=dtype),
                v_cache=torch.randn(cache_shape, device=dev, dtype=dtype), block_tables=table,
                query_start_loc=torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32),
                seq_lens=torch.full((batch,), seq_len, device=dev, dtype=torch.int32))


def _dense(paged: dict, batch: int, seq_len: int, q_len: int) -> tuple[torch.Tensor, ...]:
    """[B, heads, len, D] q/k/v gathered once, for the SDPA baseline (gather not timed)."""
    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[paged["block_tables"].long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
    q = paged["q"].view(batch, q_len, *paged["q"].shape[1:]).transpose(1, 2).contiguous()
    return q, gather(paged["k_cache"]), gather(paged["v_cache"])


def attention_case(args: argparse.Namespace, name: str, batch: int, q_len: int, context: int,
                   num_splits: int | None) -> BenchCase:
    paged = _paged(args, batch, q_len, context)
    seq_len, scale = context + q_len, args.head_dim ** -0.5
    q, k, v = _dense(paged, batch, seq_len, q_len)
    causal = q_len > 1
    # Chunked prefill needs a bottom-right causal mask; SDPA's is_causal is top-left aligned.
    mask = (torch.ones(q_len, seq_len, device=q.device, dtype=torch.bool).tril(diagonal=context)
            if causal and context else None)
    lengths = dict(max_query_len=q_len, max_seq_len=seq_len)
    elt = q.element_size()
    kv_bytes = 2 * batch * seq_len * args.num_kv_heads * args.head_dim * elt
    visible = seq_len * q_len - (q_len * (q_len - 1) // 2 if causal else 0)   # keys seen, summed over queries
    return BenchCase(
        name, f"B={batch} q={q_len} ctx={context} H={args.num_heads}/{args.num_kv_heads} D={args.head_dim}",
        {"triton": lambda: ops.triton_paged_attention(*paged.values(), scale, **lengths, num_splits=num_splits),
         "torch": lambda: paged_attention_ref(*paged.values(), scale),
         "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and not context,
                                                        scale=scale, enable_gqa=True)},
        kv_bytes + 2 * paged["q"].numel() * elt, 4 * batch * args.num_heads * args.head_dim * visible)


def elementwise_cases(args: argparse.Namespace) -> list[BenchCase]:
    """KV store, RMSNorm + residual, rotary and SiLU-and-mul over `args.tokens` tokens."""
    from ..triton import activation, kv_cache, rms_norm, rotary
    from ..reference.activation_ref import silu_and_mul_ref
    from ..reference.kv_cache_ref import store_kv_cache_ref
    from ..reference.rms_norm_ref import rms_norm_ref
    from ..reference.rotary_ref import apply_rotary_ref

    dev, dtype, t = "cuda", getattr(torch, args.dtype), args.tokens
    kvh, h, d, hidden, inter = args.num_kv_heads, args.num_heads, args.head_dim, args.hidden_size, args.intermediate_size
    elt = torch.finfo(dtype).bits // 8
    k, v = torch.randn(t, kvh, d, device=dev, dtype=dtype), torch.randn(t, kvh, d, device=dev, dtype=dtype)
    caches = [torch.empty(-(-t // args.block_size) * 2, args.block_size, kvh, d, device=dev, dtype=dtype)
              for _ in range(2)]
    slots = torch.randperm(caches[0].shape[0] * args.block_size, device=dev)[:t]
    x, res = torch.randn(t, hidden, device=dev, dtype=dtype), torch.randn(t, hidden, device=dev, dtype=dtype)
    weight = torch.rand(hidden, device=dev, dtype=dtype)
    q, qk_k = torch.randn(t, h, d, device=dev, dtype=dtype), torch.randn(t, kvh, d, device=dev, dtype=dtype)
    rope = ops.build_rope_cache(d, 8192, 500000.0, device=dev)
    positions = torch.randint(0, 8192, (t,), device=dev)
    gate_up = torch.randn(t, 2 * inter, device=dev, dtype=dtype)
    return [
        BenchCase("kv_store", f"T={t} KVH={kvh} D={d}",
                  {"triton": lambda: kv_cache.store_kv_cache(k, v, *caches, slots),
                   "torch": lambda: store_kv_cache_ref(k, v, *caches, slots)}, 4 * k.numel() * elt, 0),
        BenchCase("rms_norm+residual", f"T={t} hidden={hidden}",
                  {"triton": lambda: rms_norm.rms_norm(x, weight, 1e-5, res),
                   "torch": lambda: rms_norm_ref(x, weight, 1e-5, res)}, 4 * x.numel() * elt, 5 * x.numel()),
        BenchCase("rotary (in place)", f"T={t} H={h}/{kvh} D={d}",
                  {"triton": lambda: rotary.apply_rotary(q, qk_k, positions, rope, inplace=True),
                   "torch": lambda: apply_rotary_ref(q, qk_k, positions, rope, inplace=True)},
                  2 * (q.numel() + qk_k.numel()) * elt, 3 * (q.numel() + qk_k.numel())),
        BenchCase("silu_and_mul", f"T={t} I={inter}",
                  {"triton": lambda: activation.silu_and_mul(gate_up),
                   "torch": lambda: silu_and_mul_ref(gate_up)}, 3 * t * inter * elt, 5 * t * inter),
    ]
