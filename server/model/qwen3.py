"""Qwen3 (dense): the Llama decoder with every query and key head RMS-normalised over head_dim
before rotary (`self_attn.q_norm` / `self_attn.k_norm`), and no q/k/v bias.

Registered for `qwen3` (HF `model_type` and llama.cpp's GGUF architecture) in `registry.py`.
"""

from __future__ import annotations

from typing import ClassVar

from .llama import DecoderParts, LlamaForCausalLM
from .norm import RMSNorm


class Qwen3ForCausalLM(LlamaForCausalLM):
    parts: ClassVar[DecoderParts] = DecoderParts(qk_norm=RMSNorm)
