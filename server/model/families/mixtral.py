"""Mixtral: the Llama decoder with top-k routed SwiGLU experts in every layer (`moe.py`): softmax
over all experts, the top k re-normalised to sum to 1. Its checkpoints name the block
`block_sparse_moe` and each expert's gate, up and down `w1`, `w3`, `w2`.

Registered for `mixtral` in `registry.py`.
"""

from __future__ import annotations

from typing import ClassVar

from .llama import DecoderParts, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    parts: ClassVar[DecoderParts] = DecoderParts(feed_forward_name="block_sparse_moe", expert_names=("w1", "w3", "w2"))
