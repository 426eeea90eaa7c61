"""Segmented LoRA in torch: the reference for `lora.py` (and the contract of its SGMV kernel).

Tokens come in segments (runs of rows that share one adapter slot, `starts[i]:starts[i+1]` with
slot `slots[i]`; slot -1 = the base model, no delta). Shrink then expand, per segment:
out[rows] += (x[rows] @ a[slot].T) @ b[slot].T, the shrink kept in float32.
"""

from __future__ import annotations

import torch


def sgmv_ref(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
             accumulate: bool) -> torch.Tensor:
    """out[rows] (+)= x[rows] @ w[slot].T per segment with slot >= 0 (x [T, K], w [S, N, K],
    out [T, N]); rows of slot -1 are left as they are. Float32 accumulation."""
    bounds = starts.tolist()
    for slot, start, end in zip(slots.tolist(), bounds, bounds[1:]):
        if slot < 0 or start == end:
            continue
        product = x[start:end].float() @ w[slot].float().T
        if accumulate:
            product += out[start:end].float()
        out[start:end] = product.to(out.dtype)
    return out


def lora_shrink_expand_ref(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out += (x @ a[slot].T) @ b[slot].T per segment (a [S, R, K], b [S, N, R]), in place."""
    shrunk = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    sgmv_ref(x, a, starts, slots, shrunk, accumulate=False)
    return sgmv_ref(shrunk.to(b.dtype), b, starts, slots, out, accumulate=True)
