"""Split-KV paged attention (flash-decoding) for long contexts at small batch.

A handful of decode queries cannot fill a GPU when each (sequence, KV head) is one
program. Here the unified kernel runs with `num_splits` programs per q block, each over
one slice of the context, writing a slice-normalised partial output and its log-sum-exp;
a merge kernel combines them: out = sum_s 2^(lse_s - lse_max) out_s / sum_s 2^(lse_s - lse_max).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .unified_attention import launch_paged_attention


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
                       softcap: float | None = None, out: torch.Tensor | None = None, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """Paged attention with the context cut into `num_splits` slices; same contract as the unified kernel.

    Meant for decode (any query length works). Allocates float32 partials of
    `[T, H, num_splits, D]` per call; the merge writes every row of `out`.
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    # -inf marks splits a row never reached (idle q blocks write nothing).
    partial_lse = torch.full((num_tokens, num_heads, num_splits), float("-inf"), dtype=torch.float32,
                             device=q.device)
    launch_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, partial_out,
                           partial_lse, num_splits=num_splits, max_query_len=1, sliding_window=sliding_window,
                           softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, partial_out, partial_lse, head_dim, out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PADDED=triton.next_power_of_2(num_splits),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim))
    return out
