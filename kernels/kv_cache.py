"""KV-cache store: write this step's K and V rows into their paged slots.

Slot `s` is block `s // block_size`, offset `s % block_size`; slot -1 marks a padded
token and is skipped. One program per token copies all KV heads of K and of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kct, stride_kch,
                     stride_vcb, stride_vct, stride_vch,
                     BLOCK_SIZE: tl.constexpr, HEADS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
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
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims, v, mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write `k, v [T, num_kv_heads, D]` into the caches at `slot_mapping [T]` (int64, -1 = skip)."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim))


def check_store_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Shape and dtype checks from metadata only (no device reads)."""
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape != v_cache.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"expected k, v [T, kv_heads, D] and caches [blocks, block_size, kv_heads, D], got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: k {k.dtype} into {k_cache.dtype}, v {v.dtype} into {v_cache.dtype}")
    if min(k.stride(-1), v.stride(-1), k_cache.stride(-1), v_cache.stride(-1)) != 1:
        raise ValueError("the head_dim axis of k, v and the caches must be contiguous")
