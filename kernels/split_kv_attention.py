"""Split-KV paged attention (flash-decoding) for long contexts at small batch.

A handful of decode queries cannot fill a GPU when each (sequence, KV head) is one
program. Here every program also owns one of `num_splits` slices of the context, writes a
partial output normalised within its slice plus that slice's log-sum-exp, and a second
kernel merges the slices: out = sum_s exp(lse_s - lse_max) * out_s / sum_s exp(lse_s - lse_max).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubeinfer.kernels.attention_launch import attention_geometry
from kubeinfer.kernels.attention_tiles import attend_tiles, kv_tile_range, load_query_tile
from kubeinfer.kernels.tuning import SPLIT_KV_CONFIGS


@triton.autotune(configs=SPLIT_KV_CONFIGS, key=["HEAD_DIM_PADDED", "BLOCK_M", "BLOCK_SIZE", "NUM_SPLITS"])
@triton.jit
def _split_kv_kernel(
        partial_out_ptr, partial_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        query_start_loc_ptr, seq_lens_ptr, scale, softcap, sliding_window, num_seqs, head_dim,
        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    (q, query_pos, row_valid, token, head, seq_idx, seq_len, first_pos, last_pos,
     idle) = load_query_tile(q_ptr, query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs,
                             kv_head, stride_qt, stride_qh, head_dim, QUERIES_PER_KV, BLOCK_Q,
                             BLOCK_M, HEAD_DIM_PADDED)
    if idle:
        return
    tile_lo, tile_hi = kv_tile_range(first_pos, last_pos, seq_len, sliding_window, TILE_SIZE, USE_WINDOW)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
    split_lo = tile_lo + split * tiles_per_split
    split_hi = tl.minimum(split_lo + tiles_per_split, tile_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq_idx.to(tl.int64) * stride_bt,
        kv_head, query_pos, row_valid, seq_len, split_lo, split_hi, scale, softcap, sliding_window,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, head_dim,
        HEAD_DIM_PADDED, BLOCK_SIZE, TILE_SIZE, USE_SOFTCAP, USE_WINDOW)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))   # log2 units
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    tl.store(partial_out_ptr + token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
             + offs_d[None, :], out, mask=row_valid[:, None] & (offs_d < head_dim)[None, :])
    tl.store(partial_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(out_ptr, partial_out_ptr, partial_lse_ptr, head_dim,
                         stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         NUM_SPLITS: tl.constexpr, SPLITS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    split_valid = splits < NUM_SPLITS
    lse = tl.load(partial_lse_ptr + token * stride_lt + head * stride_lh + splits,
                  mask=split_valid, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    part = tl.load(partial_out_ptr + token * stride_pt + head * stride_ph + splits[:, None] * stride_ps
                   + offs_d[None, :], mask=split_valid[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    part = tl.where(weight[:, None] > 0.0, part, 0.0)   # unwritten partials may hold NaN
    total = tl.sum(weight, axis=0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       scale: float, *, num_splits: int, sliding_window: int | None = None,
                       softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention with the context cut into `num_splits` slices; same contract as the unified kernel.

    Meant for decode (any query length works). Allocates float32 partials of
    `[T, H, num_splits, D]` per call; the merge writes every row of `out`.
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    geo = attention_geometry(q, k_cache, v_cache, block_tables, query_start_loc)
    out = torch.empty_like(q) if out is None else out
    partial_out = torch.empty(geo.num_tokens, geo.num_heads, num_splits, geo.head_dim,
                              dtype=torch.float32, device=q.device)
    # -inf marks splits a row never reached (idle q blocks never write theirs).
    partial_lse = torch.full((geo.num_tokens, geo.num_heads, num_splits), float("-inf"),
                             dtype=torch.float32, device=q.device)
    _split_kv_kernel[(geo.num_q_blocks, geo.num_kv_heads, num_splits)](
        partial_out, partial_lse, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        scale, softcap or 0.0, sliding_window or 0, geo.num_seqs, geo.head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        QUERIES_PER_KV=geo.queries_per_kv, BLOCK_Q=geo.block_q, BLOCK_M=geo.block_m,
        HEAD_DIM_PADDED=geo.head_dim_padded, BLOCK_SIZE=geo.block_size, NUM_SPLITS=num_splits,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None)
    _merge_splits_kernel[(geo.num_tokens, geo.num_heads)](
        out, partial_out, partial_lse, geo.head_dim, out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PADDED=triton.next_power_of_2(num_splits),
        HEAD_DIM_PADDED=geo.head_dim_padded)
    return out
