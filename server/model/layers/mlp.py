"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from .linear import Linear, MergedLinear, ParallelRole


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=False,
                                         roles=[ParallelRole.COLUMN, ParallelRole.COLUMN])
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, role=ParallelRole.ROW)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))
