"""Pure-torch rotary embedding (HF rotate_half convention), the reference for `rotary.py`."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` dims of `x [T, heads, D]` in float32; the rest pass through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q [T, H, D]` and `k [T, KVH, D]` by `positions [T]`; returns (q, k)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
    if not inplace:
        return q_rot, k_rot
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k
