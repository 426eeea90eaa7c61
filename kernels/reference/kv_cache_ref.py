"""Pure-torch KV-cache store, the reference for `kv_cache.store_kv_cache` and its CPU path, and
the fp8 cache's conversions (per-tensor scale: stored = x / scale in fp8, read = stored x scale)."""

from __future__ import annotations

import numpy as np
import torch

# largest finite value of each fp8 format: values past it are stored saturated (vLLM's kernels do)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def inverse_scale(scale: float) -> float:
    """1 / scale rounded to float32: every kernel multiplies by this same number (numpy's
    rounding, torch's too, without a torch op inside a recorded decode step)."""
    return float(np.float32(1.0 / scale))


def quantize_fp8_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale (as x times the float32 inverse) in fp8 `dtype`, saturating, rounded to nearest even."""
    limit = FP8_MAX[dtype]
    return (x.float() * inverse_scale(scale)).clamp(-limit, limit).to(dtype)


def dequantize_fp8_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 values of `x` times `scale`, in `dtype` (float32 product, rounded once)."""
    return (x.float() * scale).to(dtype)


def store_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write `k, v [T, kv_heads, D]` at `slot_mapping` (-1 = skip); works for any cache strides.
    An fp8 cache gets them quantized with the per-tensor scales."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = k[keep], v[keep]
    if k_cache.dtype in FP8_MAX:
        k, v = quantize_fp8_ref(k, k_scale, k_cache.dtype), quantize_fp8_ref(v, v_scale, v_cache.dtype)
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))   # fp8 indexing is not on CPU
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v
