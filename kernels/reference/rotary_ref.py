"""Pure-torch rotary embeddings (HF rotate_half convention): the float32 reference for the
Triton `rotary.py`, and HF's own bf16 rounding for the CPU path (`rotate_signed_ref`)."""

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


def rotate_signed_ref(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` for `x [T, heads, D]` and per-token cos and
    sin `[T, 1, D]` whose first half is negated (folding rotate_half's sign into the table): the
    same products and roundings in the model dtype, bit-identical, in four ops instead of six; no
    addcmul, whose single rounding would differ from transformers' in bf16."""
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)   # (x2, x1)
    return swapped.mul_(signed_sin).add_(x * cos)
