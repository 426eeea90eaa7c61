"""Multi-LoRA in Triton: one segmented gather matmul (SGMV, as Punica / S-LoRA call it) used
twice, shrink (x @ A[slot].T into float32 [T, R]) then expand (+= that @ B[slot].T into the
layer's output). Same contract as `lora_ref.lora_shrink_expand_ref`.

A segment is a run of rows sharing one adapter slot (one sequence's tokens, or several); a
program owns BLOCK_M rows of one segment and BLOCK_N output columns and loads only its slot's
matrix, so a decode batch of one token per sequence is BGMV (one row per segment) and a long
prefill is a dense GEMM. Segments of slot -1 (the base model) launch programs that return at
once; segments write disjoint rows, so the expand accumulates without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, starts_ptr, slots_ptr, N, K,
                 stride_xm, stride_ws, stride_wn, stride_om,
                 ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows] (+)= x[rows] @ w[slot].T for BLOCK_M rows of segment program_id(0)."""
    segment = tl.program_id(0)
    slot = tl.load(slots_ptr + segment).to(tl.int64)
    start = tl.load(starts_ptr + segment)
    end = tl.load(starts_ptr + segment + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if slot >= 0 and first < end:
        rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < end
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            xs = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                         other=0.0)
            ws = tl.load(w_ptr + slot * stride_ws + cols[None, :] * stride_wn + ks[:, None],
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(xs.to(ws.dtype), ws, acc)
        offsets = rows[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
         longest: int, accumulate: bool) -> torch.Tensor:
    """out[rows] (+)= x[rows] @ w[slot].T per segment (see `lora_ref.sgmv_ref`); `longest` is the
    longest segment, a host int (no device sync to size the grid)."""
    n, k = w.shape[1], w.shape[2]
    block_m = 16 if longest <= 16 else 64
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (slots.shape[0], triton.cdiv(longest, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](x, w, out, starts, slots, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                       ACCUMULATE=accumulate, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor,
                       slots: torch.Tensor, longest: int) -> torch.Tensor:
    """out += (x @ a[slot].T) @ b[slot].T per segment, in place (a [S, R, K], b [S, N, R])."""
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    assert out.stride(1) == 1, "out must be row-major"
    shrunk = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    sgmv(x, a, starts, slots, shrunk, longest, accumulate=False)
    return sgmv(shrunk, b, starts, slots, out, longest, accumulate=True)
