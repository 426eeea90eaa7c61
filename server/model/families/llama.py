"""Llama-family causal LM over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5.

The variants differ only in config (q/k/v bias, tied lm_head, rope scaling), so one module
serves them all. Parameter names follow transformers' checkpoints (`model.layers.N...`), with
q/k/v and gate/up merged; `CausalLM.load_weights` routes checkpoint tensors into the merged
matrices. Registered for `llama`, `mistral` and `qwen2` in `registry.py`.

It is also the shared pre-norm decoder of the other families: a family subclasses
`LlamaForCausalLM` and names what it changes in `DecoderParts` (q/k norms, the feed-forward
block and its checkpoint names), e.g. `qwen3.py`, `mixtral.py`; a config with `moe` gets
routed experts (`moe.py`) on its sparse layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import nn

from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from ..layers.attention import AttentionBackend
from ..layers.mlp import SwiGLUMLP
from ..layers.moe import GATE_UP_DOWN, SparseMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.self_attention import NormFactory, SelfAttention
from .causal_lm import CausalLM

# checkpoint projection name -> (merged module name, shard index)
PACKED_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def swiglu_mlp(config: ModelConfig, layer: int) -> nn.Module:
    return SwiGLUMLP(config.hidden_size, config.intermediate_size)


@dataclass(frozen=True)
class DecoderParts:
    """What a family changes in the shared decoder layer (the defaults are Llama's). Layers that
    `config.moe` makes sparse get top-k routed SwiGLU experts instead of the dense `mlp`."""

    qk_norm: NormFactory | None = None                                  # per-head q/k norm before rotary
    mlp: Callable[[ModelConfig, int], nn.Module] = swiglu_mlp           # dense feed-forward of layer N
    feed_forward_name: str = "mlp"                  # the checkpoint's module name (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = GATE_UP_DOWN   # each expert's gate, up, down (Mixtral: w1, w3, w2)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, parts: DecoderParts = DecoderParts(),
                 index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, backend, qk_norm=parts.qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        sparse = moe is not None and index not in moe.dense_layers
        self.feed_forward_name = parts.feed_forward_name
        setattr(self, parts.feed_forward_name, SparseMoE(config.hidden_size, moe, parts.expert_names) if sparse
                else parts.mlp(config, index))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rotary, kv_cache, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.feed_forward_name)(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, parts: DecoderParts = DecoderParts()) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, parts, index)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    packed_modules = PACKED_MODULES
    parts: ClassVar[DecoderParts] = DecoderParts()

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config)
        if config.layer_types:
            raise ValueError(f"{config.architecture}: models that mix sliding-window and full-attention layers are "
                             "not supported (only Gemma 2/3's are)")
        self.model = LlamaModel(config, backend, self.parts)
        self.build_lm_head()

    def hidden_states(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x, residual = self.decoder_layers(self.model.embed_tokens(batch.input_ids), batch, kv_caches)
        return self.final_norm(x, residual, batch.logits_indices)

    def decoder_layers(self, x: torch.Tensor, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over the embedded tokens `x`: the last layer's (x, residual), their
        sum not yet normed (a CPU decode graph records this part, server/engine/cpu_graphs.py)."""
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, self.model.rotary_emb, kv_cache, batch)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states of `rows`: only the rows that need logits go through the final
        norm and the (large) lm_head."""
        return self.model.norm(x[rows] + residual[rows])
