"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's own parts, each small and named here.

- `GemmaRMSNorm`: scales by (1 + weight), multiplied in float32 before the cast;
- sandwich norms: each of attention and MLP is normalised before *and* after, then added to
  the residual stream;
- `GeGLUMLP`: down(gelu_tanh(gate) * up);
- the embeddings scaled by sqrt(hidden_size), in the activations' dtype;
- attention scaled by 1/sqrt(query_pre_attn_scalar), interleaved sliding-window ("local") and
  global layers (`config.layer_types`), each layer with its own attention backend
  (`AttentionBackend.for_layer`); Gemma 2 soft-caps the scores (`attn_logit_softcapping`);
- Gemma 2 soft-caps the final logits (`final_logit_softcapping`);
- Gemma 3: q/k norms (as Qwen3, with `GemmaRMSNorm`), and its local layers rotate with their
  own rope base (`rope_local_theta`) while global ones use `rope_theta` and its scaling.

Registered for `gemma2` and `gemma3_text` in `registry.py`. Every layer shares the paged KV
cache; local layers mask by their window.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from ..layers.attention import AttentionBackend
from ..layers.mlp import SwiGLUMLP
from ..layers.rotary import RotaryEmbedding
from ..layers.self_attention import SelfAttention
from .causal_lm import CausalLM
from .llama import PACKED_MODULES

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(nn.Module):
    """RMSNorm times (1 + weight), in float32 and cast once at the end (transformers' Gemma2RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).to(x.dtype)


class GeGLUMLP(SwiGLUMLP):
    """down(gelu_tanh(gate(x)) * up(x)): SwiGLU's layers (and parallel roles) with Gemma's activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, local: bool, qk_norm: bool) -> None:
        super().__init__()
        self.local = local
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = SelfAttention(
            config, backend.for_layer(config.sliding_window if local else None, config.attn_logit_softcapping),
            qk_norm=GemmaRMSNorm if qk_norm else None)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, kv_cache, batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings)
        self.rotary_emb_local = (RotaryEmbedding(config.head_dim, config.rope_local_theta, None,
                                                 config.max_position_embeddings)
                                 if config.rope_local_theta is not None else None)
        local = [config.sliding_window is not None and (not config.layer_types or kind == "sliding_attention")
                 for kind in (config.layer_types or ["sliding_attention"] * config.num_hidden_layers)]
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, backend, local[i], qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma2ForCausalLM(CausalLM):
    packed_modules = PACKED_MODULES
    qk_norm: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config)
        if config.hidden_act not in GELU_TANH:
            raise ValueError(f"{config.architecture}: hidden activation {config.hidden_act!r} is not supported "
                             f"(supported: {', '.join(GELU_TANH)})")
        if config.moe is not None:
            raise ValueError(f"{config.architecture}: mixture-of-experts layers are not supported")
        self.model = GemmaModel(config, backend, self.qk_norm)
        self.build_lm_head()

    def hidden_states(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        local = self.model.rotary_emb_local or self.model.rotary_emb
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, local if layer.local else self.model.rotary_emb, kv_cache, batch)
        return self.model.norm(x[batch.logits_indices])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, soft-capped by `final_logit_softcapping` (Gemma 2)."""
        logits = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: Gemma 2's layers plus q/k norms; no score soft-cap in its configs."""

    qk_norm: ClassVar[bool] = True
