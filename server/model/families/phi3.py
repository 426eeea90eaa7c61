"""Phi-3 / Phi-4: the Llama decoder whose checkpoints stack q|k|v in `self_attn.qkv_proj` and
gate|up in `mlp.gate_up_proj`. Those are split into their projections as they are read (before
tensor parallelism slices them), so loading, sharding and the merged GEMMs are the Llama ones.
Phi-3-mini-4k's `sliding_window` is honoured as transformers does.

Registered for `phi3` in `registry.py`.
"""

from __future__ import annotations

from ..checkpoints.checkpoint import FusedParts
from ..config import ModelConfig
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def fused_checkpoint_parts(cls, config: ModelConfig) -> FusedParts:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return {"self_attn.qkv_proj": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
                "mlp.gate_up_proj": [("mlp.gate_proj", config.intermediate_size),
                                     ("mlp.up_proj", config.intermediate_size)]}
