"""SiLU-and-mul in Triton: reads the fused gate|up projection once, writes the product.

Grid (rows, column blocks); the math runs in float32 and is rounded once on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 1024 columns x 2 inputs per program: enough bytes per program to stream at full HBM
# bandwidth on Ampere and Hopper, small enough that a 14336-wide MLP still spans 14 programs.
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for `x [..., 2I]`; same contract as `silu_and_mul_ref`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last axis (gate|up), got {x.shape[-1]}")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(_BLOCK, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
        out, rows, width, rows.stride(0), out.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], width)
