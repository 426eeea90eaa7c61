"""KV-cache store: write this step's K and V rows into their paged slots.

Slot `s` is block `s // block_size`, offset `s % block_size`; slot -1 marks a padded
token and is skipped. One program per token copies all KV heads of K and of V. An fp8 cache
gets them quantized with per-tensor scales, as `kv_cache_ref.quantize_fp8_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.kv_cache_ref import FP8_MAX, inverse_scale

# fp8 format -> (mantissa bits, smallest normal exponent)
_FP8_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def round_to_fp8(x, MANTISSA_BITS: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr, MIN_NORMAL: tl.constexpr,
                 LARGEST: tl.constexpr):
    """float32 `x` saturated to +-LARGEST and rounded to nearest even onto the fp8 format's values,
    still float32: the cast to fp8 after it is exact, so every backend stores the same bytes as
    torch (the interpreter's own fp8 rounding loses a carry into the exponent)."""
    a = tl.minimum(tl.abs(x), LARGEST)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + ((1 << (22 - MANTISSA_BITS)) - 1) + ((bits >> (23 - MANTISSA_BITS)) & 1)) \
        & ~((1 << (23 - MANTISSA_BITS)) - 1)
    # below MIN_NORMAL the values are multiples of the smallest subnormal: a float32 add of a
    # number whose last mantissa bit is worth exactly that rounds to them, ties to even
    r = tl.where(a < MIN_NORMAL, (a + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC, bits.to(tl.float32, bitcast=True))
    # the sign goes back as a bit: compiled `-r` is `0 - r`, which turns -0 (torch's byte 0x80 for
    # tiny negatives) into +0 (seen on an H200)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kct, stride_kch,
                     stride_vcb, stride_vct, stride_vch, k_inv_scale, v_inv_scale,
                     BLOCK_SIZE: tl.constexpr, HEADS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                     QUANTIZE: tl.constexpr, MANTISSA_BITS: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
                     MIN_NORMAL: tl.constexpr, LARGEST: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if QUANTIZE:
        k = round_to_fp8(k.to(tl.float32) * k_inv_scale, MANTISSA_BITS, SUBNORMAL_MAGIC, MIN_NORMAL, LARGEST)
        v = round_to_fp8(v.to(tl.float32) * v_inv_scale, MANTISSA_BITS, SUBNORMAL_MAGIC, MIN_NORMAL, LARGEST)
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims, v, mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write `k, v [T, num_kv_heads, D]` into the caches at `slot_mapping [T]` (int64, -1 = skip);
    an fp8 cache holds k / k_scale and v / v_scale."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    mantissa_bits, min_exponent = _FP8_FORMAT.get(k_cache.dtype, (0, 0))
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), inverse_scale(k_scale), inverse_scale(v_scale),
        BLOCK_SIZE=k_cache.shape[1], HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), QUANTIZE=k_cache.dtype in FP8_MAX,
        MANTISSA_BITS=mantissa_bits, SUBNORMAL_MAGIC=2.0 ** (23 + min_exponent - mantissa_bits),
        MIN_NORMAL=2.0 ** min_exponent, LARGEST=FP8_MAX.get(k_cache.dtype, 0.0))


def check_store_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Shape and dtype checks from metadata only (no device reads)."""
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape != v_cache.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"expected k, v [T, kv_heads, D] and caches [blocks, block_size, kv_heads, D], got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (k.dtype, *FP8_MAX):
        raise ValueError(f"dtype mismatch: k {k.dtype} into {k_cache.dtype}, v {v.dtype} into {v_cache.dtype}")
    if min(k.stride(-1), v.stride(-1), k_cache.stride(-1), v_cache.stride(-1)) != 1:
        raise ValueError("the head_dim axis of k, v and the caches must be contiguous")
