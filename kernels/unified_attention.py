"""Unified paged attention: prefill chunks and decode tokens of many sequences in one launch.

The vLLM v1 idea: every sequence contributes its new tokens to one flat query batch, and
one kernel attends each of them over its cached prefix plus the causal part of its own
chunk. Grid: (q blocks, KV heads); each program streams its sequence's KV tiles once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubeinfer.kernels.attention_launch import attention_geometry
from kubeinfer.kernels.attention_tiles import attend_tiles, kv_tile_range, load_query_tile
from kubeinfer.kernels.tuning import ATTENTION_CONFIGS


# IS_DECODE only keys the autotuner: decode and prefill prefer different tiles.
@triton.autotune(configs=ATTENTION_CONFIGS, key=["HEAD_DIM_PADDED", "BLOCK_M", "BLOCK_SIZE", "IS_DECODE"])
@triton.jit
def _unified_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale, softcap, sliding_window, num_seqs, head_dim,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_bt,
        QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr,
        USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IS_DECODE: tl.constexpr):
    kv_head = tl.program_id(1)
    (q, query_pos, row_valid, token, head, seq_idx, seq_len, first_pos, last_pos,
     idle) = load_query_tile(q_ptr, query_start_loc_ptr, seq_lens_ptr, tl.program_id(0), num_seqs,
                             kv_head, stride_qt, stride_qh, head_dim, QUERIES_PER_KV, BLOCK_Q,
                             BLOCK_M, HEAD_DIM_PADDED)
    if idle:
        return
    tile_lo, tile_hi = kv_tile_range(first_pos, last_pos, seq_len, sliding_window, TILE_SIZE, USE_WINDOW)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq_idx.to(tl.int64) * stride_bt,
        kv_head, query_pos, row_valid, seq_len, tile_lo, tile_hi, scale, softcap, sliding_window,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, head_dim,
        HEAD_DIM_PADDED, BLOCK_SIZE, TILE_SIZE, USE_SOFTCAP, USE_WINDOW)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_d < head_dim)[None, :])


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, *, max_query_len: int, sliding_window: int | None = None,
                      softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention of `q [T, H, D]`; same contract as `attention_ref.paged_attention_ref`.

    `max_query_len` is a host-side int (no sync) that picks decode or prefill tuning.
    Rows of `out` past `query_start_loc[-1]` (padding) are left untouched.
    """
    geo = attention_geometry(q, k_cache, v_cache, block_tables, query_start_loc)
    out = torch.empty_like(q) if out is None else out
    _unified_attention_kernel[(geo.num_q_blocks, geo.num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        scale, softcap or 0.0, sliding_window or 0, geo.num_seqs, geo.head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=geo.queries_per_kv, BLOCK_Q=geo.block_q, BLOCK_M=geo.block_m,
        HEAD_DIM_PADDED=geo.head_dim_padded, BLOCK_SIZE=geo.block_size,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        IS_DECODE=max_query_len == 1)
    return out
