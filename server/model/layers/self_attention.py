"""The attention layer of a decoder block: fused q/k/v projection, rotary, paged attention, output.

The attention math itself, and the form of the rotary embedding it needs, live behind
`AttentionBackend` (torch on CPU, Triton on CUDA); this layer only shapes tensors for it.
Families switch on its optional parts: `qk_norm` (Qwen3, Gemma 3: each query and key head
normalised before rotary) and their own backend per layer (Gemma's sliding-window and
soft-capped layers, `AttentionBackend.for_layer`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from .attention import AttentionBackend
from .kv_cache_quant import LayerKVCache
from .linear import Linear, MergedLinear, ParallelRole
from .rotary import RotaryEmbedding

NormFactory = Callable[[int, float], nn.Module]


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, qk_norm: NormFactory | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5   # Gemma: query_pre_attn_scalar
        self.backend = backend
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias,
                                     roles=[ParallelRole.COLUMN, ParallelRole.KV_COLUMN, ParallelRole.KV_COLUMN])
        self.o_proj = Linear(q_size, config.hidden_size, bias=False, role=ParallelRole.ROW)
        # checkpoint names `self_attn.q_norm` / `self_attn.k_norm`: weights [head_dim], shared by all heads
        self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._normalize_qk(qkv)
        qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim)
        q, k = self.backend.rotate(qk, self.num_heads, rotary, batch)
        v = qkv[:, -self.num_kv_heads * self.head_dim:].view(num_tokens, self.num_kv_heads, self.head_dim)
        scales = kv_cache.scales if isinstance(kv_cache, LayerKVCache) else None   # fp8 caches have them
        if scales is not None and scales.calculate:
            scales.observe(k, v)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale, scales)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """q|k|v with every query and key head normalised over head_dim (before rotary)."""
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return torch.cat([q, k, v], dim=-1)
