"""Fused RMSNorm (+ residual add) in Triton: one program normalises one row in registers.

With a residual, the kernel reads x and residual once and writes both the normalised row
and the new residual, saving a full read-write pass over the hidden states per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import RMS_NORM_CONFIGS


@triton.autotune(configs=RMS_NORM_CONFIGS, key=["BLOCK"])
@triton.jit
def _rms_norm_kernel(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, hidden_size, eps,
                     stride_x, stride_r, stride_o, stride_ro, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    out = weight * (x32 * inv_rms).to(x.dtype)   # round like HF before the weight multiply
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis of `x [..., hidden]`; same contract as `rms_norm_ref`."""
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    rows = x.reshape(-1, hidden_size)
    res = rows if residual is None else residual.reshape(-1, hidden_size)
    if rows.stride(-1) != 1 or res.stride(-1) != 1:
        raise ValueError("rms_norm needs the hidden axis contiguous")
    out = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    residual_out = torch.empty_like(rows) if residual is not None else out
    _rms_norm_kernel[(rows.shape[0],)](
        out, residual_out, rows, res, weight, hidden_size, eps,
        rows.stride(0), res.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden_size))
    out = out.view(x.shape)
    return out if residual is None else (out, residual_out.view(x.shape))
