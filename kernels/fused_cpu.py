"""Fused RMSNorm(+residual) and SiLU-and-mul for CPU tensors: `fused_cpu.c` via `cpu_build`.

One call replaces the ~10 torch ops of HF's RMSNorm (float copy, pow, mean, rsqrt, casts,
products, the residual add) and the 3 of SiLU-and-mul, with the same roundings (see the C file).
"""

from __future__ import annotations

from functools import cache

import torch

from . import cpu_build

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@cache
def _functions(dtype: torch.dtype) -> tuple | None:
    library = cpu_build.load("fused_cpu")
    if library is None or dtype not in _SUFFIX:
        return None
    suffix = _SUFFIX[dtype]
    return (cpu_build.bind(library, f"rms_norm_{suffix}", pointers=5, ints=2, floats=1),
            cpu_build.bind(library, f"silu_and_mul_{suffix}", pointers=2, ints=2))


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels take `x` (a CPU tensor of a supported dtype, kernels built)."""
    return x.device.type == "cpu" and _functions(x.dtype) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As `rms_norm_ref`: with `residual`, returns (normed, x + residual) in new tensors."""
    norm, _ = _functions(x.dtype)
    x = x.contiguous()
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = torch.empty_like(x)
    weight = weight.to(x.dtype).contiguous()
    if residual is None:
        norm(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
        return out
    residual = residual.to(x.dtype).contiguous()
    summed = torch.empty_like(x)
    norm(x.data_ptr(), residual.data_ptr(), summed.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` as `silu_and_mul_ref`."""
    _, fused = _functions(x.dtype)
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    fused(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter)
    return out
