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
        return ops.rms_norm(x, self.weight, self.eps, residual)
