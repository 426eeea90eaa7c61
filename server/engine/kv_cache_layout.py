"""One rank's paged KV cache: its layout, its size in bytes, and its allocation.

Rank 0's model runner sizes the cache from its memory budget and every worker allocates the same
number of blocks for its own layers and KV heads (`parallel/worker.py`); a draft model's runner
sizes its cache to hold as many tokens as the target's. All of them lay the cache out here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.layers.kv_cache_quant import KVScales, LayerKVCache, layer_kv_scales
from .cpu_cache_memory import lazy_zeros, map_in_background


@dataclass(frozen=True)
class KVCacheLayout:
    """K and V blocks of `block_size` tokens x `num_kv_heads` heads x `head_dim`, one pair per layer."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return self.block_size, self.num_kv_heads, self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Over all layers, K and V."""
        return 2 * self.num_layers * int(np.prod(self.block_shape)) * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device, kv_scales: dict[str, KVScales],
                 calculate_kv_scales: bool) -> list[LayerKVCache]:
        """Zeroed caches with each layer's fp8 scales (the checkpoint's, or calculated when asked).
        On the CPU their pages are mapped in the background (`cpu_cache_memory.py`)."""
        shape = (num_blocks, *self.block_shape)
        if device.type == "cpu":
            def zeros() -> torch.Tensor:
                return lazy_zeros(shape, self.dtype)
        else:
            def zeros() -> torch.Tensor:
                return torch.zeros(shape, dtype=self.dtype, device=device)
        scales = layer_kv_scales(self.num_layers, self.dtype, kv_scales, calculate_kv_scales)
        caches = [LayerKVCache(zeros(), zeros(), layer_scales) for layer_scales in scales]
        if device.type == "cpu":
            map_in_background([cache for layer in caches for cache in (layer.k, layer.v)])
        return caches
