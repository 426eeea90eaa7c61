"""Rotary embedding in Triton: one program per token rotates all its query and key heads.

cos/sin come from the float32 table of `rope_cache.build_rope_cache`; the rotation runs
in float32 and is written back in the input dtype. Dims past `rotary_dim` are untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, cos, sin, half,
                  HEADS_PADDED: tl.constexpr, HALF_PADDED: tl.constexpr):
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HALF_PADDED)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, num_heads, num_kv_heads, half,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
                   Q_HEADS_PADDED: tl.constexpr, K_HEADS_PADDED: tl.constexpr, HALF_PADDED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    row = cos_sin_ptr + position * stride_cache
    cos = tl.load(row + dims, mask=dims < half, other=1.0)[None, :]
    sin = tl.load(row + half + dims, mask=dims < half, other=0.0)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, num_heads, cos, sin, half, Q_HEADS_PADDED, HALF_PADDED)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, cos, sin, half, K_HEADS_PADDED, HALF_PADDED)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q [T, H, D]` and `k [T, KVH, D]` by `positions [T]` (each < the cache's rows)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or positions.shape != (q.shape[0],):
        raise ValueError(f"apply_rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim > q.shape[-1] or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be float32 [positions, rotary_dim <= {q.shape[-1]}], "
                         f"got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    if not inplace:
        q, k = q.clone(), k.clone()
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rotary needs the head_dim axis contiguous")
    half = rotary_dim // 2
    _rotary_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache, q.shape[1], k.shape[1], half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        Q_HEADS_PADDED=triton.next_power_of_2(q.shape[1]), K_HEADS_PADDED=triton.next_power_of_2(k.shape[1]),
        HALF_PADDED=triton.next_power_of_2(half))
    return q, k
