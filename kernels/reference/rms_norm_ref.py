"""Pure-torch RMSNorm with optional fused residual add, matching Hugging Face's LlamaRMSNorm.

The residual sum is rounded to the model dtype before it is normalised, exactly as the
unfused `hidden = residual + hidden; norm(hidden)` sequence does.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`weight * x / rms(x)` over the last axis; with `residual`, returns (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)
