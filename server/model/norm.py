"""RMSNorm with an optional fused residual add (the pre-norm decoder's two hot adds)."""

from __future__ import annotations

import torch
from torch import nn

from kubeinfer.kernels import ops


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, exactly as transformers' LlamaRMSNorm,
    so low-precision logits track the reference."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual`: `(norm(x + residual), x + residual)`."""
        if ops.uses_triton(x):   # one fused pass over x and residual
            return ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)
