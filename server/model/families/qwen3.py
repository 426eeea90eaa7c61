"""Qwen3 (dense): the Llama decoder with every query and key head RMS-normalised over head_dim
before rotary (`self_attn.q_norm` / `self_attn.k_norm`), and no q/k/v bias.

Qwen3-MoE is the same module: its config's `moe` (`MoEConfig`) gives the layers that
`decoder_sparse_step` / `mlp_only_layers` make sparse top-k routed SwiGLU experts under
transformers' names (router `mlp.gate`, `mlp.experts.{e}.gate_proj` ...), the top-k weights
re-normalised only with `norm_topk_prob`.

Registered for `qwen3` and `qwen3_moe` (HF `model_type`) in `registry.py`.
"""

from __future__ import annotations

from typing import ClassVar

from ..layers.norm import RMSNorm
from .llama import DecoderParts, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    parts: ClassVar[DecoderParts] = DecoderParts(qk_norm=RMSNorm)
