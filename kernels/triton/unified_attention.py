"""Unified paged attention: prefill chunks and decode tokens of many sequences in one launch.

The vLLM v1 idea: every sequence contributes its new tokens to one flat query batch, and
one kernel attends each of them over its cached prefix plus the causal part of its own
chunk. Grid: (q blocks, KV heads, splits); each program streams its sequence's KV tiles
once. With one split it writes the final output; with more (`split_kv_attention.py`) each
program writes its slice's partial output and log-sum-exp for a merge kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_launch import attention_geometry
from .attention_tiles import attend_tiles, kv_tile_range, load_query_tile
from .tuning import ATTENTION_CONFIGS


# IS_DECODE only keys the autotuner: decode and prefill prefer different tiles.
@triton.autotune(configs=ATTENTION_CONFIGS,
                 key=["HEAD_DIM_PADDED", "BLOCK_M", "BLOCK_SIZE", "NUM_SPLITS", "IS_DECODE"])
@triton.jit
def _paged_attention_kernel(
        out_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale, v_scale, softcap, sliding_window, num_seqs, head_dim,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
        QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
        USE_WINDOW: tl.constexpr, IS_DECODE: tl.constexpr):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    (q, query_pos, row_valid, token, head, seq_idx, seq_len, first_pos, last_pos,
     idle) = load_query_tile(q_ptr, query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs,
                             kv_head, stride_qt, stride_qh, head_dim, QUERIES_PER_KV, BLOCK_Q,
                             BLOCK_M, HEAD_DIM_PADDED)
    if idle:
        return
    tile_lo, tile_hi = kv_tile_range(first_pos, last_pos, seq_len, sliding_window, split,
                                     NUM_SPLITS, TILE_SIZE, USE_WINDOW)
    m_i, l_i, acc = attend_tiles(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq_idx.to(tl.int64) * stride_bt,
        kv_head, query_pos, row_valid, seq_len, tile_lo, tile_hi, scale, softcap, sliding_window,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, head_dim,
        BLOCK_M, HEAD_DIM_PADDED, BLOCK_SIZE, TILE_SIZE, USE_SOFTCAP, USE_WINDOW)
    seen = l_i > 0.0   # False for rows whose visible keys all lie in other splits
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_d < head_dim)[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))   # log2 units
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_valid)


def launch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, out: torch.Tensor, lse: torch.Tensor | None, *, num_splits: int,
                           max_query_len: int, sliding_window: int | None, softcap: float | None,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One launch: final rows into `out` [T, H, D], or with `lse` [T, H, splits] per-split partial
    rows into float32 `out` [T, H, splits, D] and their log-sum-exps into `lse`. An fp8 cache
    holds K / k_scale and V / v_scale. `max_query_len` (host int) picks decode or prefill tiles."""
    geo = attention_geometry(q, k_cache, v_cache, block_tables, query_start_loc, max_query_len)
    out_split_stride = out.stride(2) if lse is not None else 0
    write_lse, lse = lse is not None, out if lse is None else lse   # `out` stands in, never written
    _paged_attention_kernel[(geo.num_q_blocks, geo.num_kv_heads, num_splits)](
        out, lse, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        scale * k_scale, v_scale, softcap or 0.0, sliding_window or 0, geo.num_seqs, geo.head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), out_split_stride, lse.stride(0), lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=geo.queries_per_kv, BLOCK_Q=geo.block_q, BLOCK_M=geo.block_m,
        HEAD_DIM_PADDED=geo.head_dim_padded, BLOCK_SIZE=geo.block_size, NUM_SPLITS=num_splits,
        WRITE_LSE=write_lse, USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        IS_DECODE=max_query_len == 1)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, *, max_query_len: int, sliding_window: int | None = None,
                      softcap: float | None = None, out: torch.Tensor | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Paged attention of `q [T, H, D]`; same contract as `attention_ref.paged_attention_ref`.

    `max_query_len` is a host-side int (no sync) that picks decode or prefill tuning.
    Rows of `out` past `query_start_loc[-1]` (padding) are left untouched.
    """
    out = torch.empty_like(q) if out is None else out
    launch_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, None,
                           num_splits=1, max_query_len=max_query_len, sliding_window=sliding_window,
                           softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    return out
