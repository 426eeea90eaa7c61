"""The engine's AttentionBackend on kubeinfer's Triton kernels (the CUDA path).

Per layer: one launch stores this step's K/V at `slot_mapping`, one (or two, split-KV)
launches attend. Everything the launches need is a tensor of the ForwardBatch or a
host-side int it already carries, so no layer ever waits on the GPU.
"""

from __future__ import annotations

import torch

from kubeinfer.kernels import ops

from ..forward_batch import ForwardBatch
from .kv_cache_quant import KVScales
from .rotary import RotaryEmbedding


class TritonAttention:
    """Unified paged attention (prefill chunks + decode in one launch), split-KV for long decode."""

    def __init__(self, sliding_window: int | None = None, softcap: float | None = None) -> None:
        self.sliding_window = sliding_window
        self.softcap = softcap

    def for_layer(self, sliding_window: int | None, softcap: float | None) -> "TritonAttention":
        return TritonAttention(sliding_window, softcap)

    def rotate(self, qk: torch.Tensor, num_heads: int, rotary: RotaryEmbedding, batch: ForwardBatch
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, from the position-indexed cos|sin table (no per-step tensors)."""
        q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
        return ops.apply_rotary(q, k, *rotary.indexed_table(batch), inplace=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] after rotary; returns [T, heads, d]. An fp8 cache
        holds k / kv_scales.k and v / kv_scales.v (quantized by the store, read by attention)."""
        k_scale, v_scale = (kv_scales.k, kv_scales.v) if kv_scales is not None else (1.0, 1.0)
        ops.triton_store_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        return ops.triton_paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale,
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
            sliding_window=self.sliding_window, softcap=self.softcap, k_scale=k_scale, v_scale=v_scale)
