"""Pure-torch KV-cache store, the reference for `kv_cache.store_kv_cache` and its CPU path."""

from __future__ import annotations

import torch


def store_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Write `k, v [T, kv_heads, D]` at `slot_mapping` (-1 = skip); works for any cache strides."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]
