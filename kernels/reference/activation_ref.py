"""Pure-torch SiLU-and-mul (the SwiGLU gate), the reference for `activation.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for `x [..., 2I]`, as HF's `act(gate) * up`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
