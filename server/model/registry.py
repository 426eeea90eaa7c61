"""Model families: architecture name -> model class and GGUF tensor names (vLLM's model registry).

A new family is one module in `families/` (a `CausalLM` subclass built from `ModelConfig` and an
attention backend out of `layers/`) plus one `register_model` call. The loaders, the
GGUF conversion and tensor parallelism look the family up here and name no architecture
themselves; tensor parallelism comes from the roles of the family's linear layers
(`layers.linear.ParallelRole`). This module imports nothing heavy: `ModelConfig` validates against it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from torch import nn

    from .config import ModelConfig
    from .layers.attention import AttentionBackend


@dataclass(frozen=True)
class GGUFNames:
    """llama.cpp's tensor names for a family, and which of its tensors hold q/k rows in
    llama.cpp's interleaved rotary order."""

    global_names: Mapping[str, str]
    block_names: Mapping[str, str]
    # transformers module (inside a layer) -> "q" or "k": rows permuted by llama.cpp's converter
    permuted_rope_rows: Mapping[str, str] = field(default_factory=dict)
    # added by llama.cpp's converter to every `*norm.weight` (Gemma: its norms scale by 1 + w, llama.cpp's by w)
    norm_shift: float = 0.0

    def expert_names(self, gguf_name: str, num_experts: int) -> list[str] | None:
        """The transformers names of the per-expert matrices a stacked GGUF expert tensor holds
        (`blk.3.ffn_gate_exps.weight` [E, I, H] -> `model.layers.3.mlp.experts.{e}.gate_proj.weight`),
        None for any other tensor."""
        match = re.fullmatch(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight", gguf_name)
        if not match:
            return None
        projection = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[match[2]]
        return [f"model.layers.{match[1]}.mlp.experts.{e}.{projection}.weight" for e in range(num_experts)]

    def hf_name(self, gguf_name: str) -> str:
        """The transformers name of GGUF tensor `gguf_name` (`blk.3.attn_q.weight` ->
        `model.layers.3.self_attn.q_proj.weight`)."""
        if gguf_name in self.global_names:
            return self.global_names[gguf_name]
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
        if not match or match[2] not in self.block_names:
            raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")
        return f"model.layers.{match[1]}.{self.block_names[match[2]]}.{match[3]}"

    def rope_heads(self, hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
        """How many heads' rows of tensor `hf_name` are in llama.cpp's rotary order (None: as in
        transformers). A head's rows stay together, so a tensor-parallel shard of whole heads
        passes its own head counts."""
        module = hf_name.rpartition(".")[0].split(".", 3)[-1]
        kind = self.permuted_rope_rows.get(module)
        return None if kind is None else num_heads if kind == "q" else num_kv_heads


_LLAMA_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs.weight"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}   # the MoE router
# Only llama.cpp's `llama` converter permutes q/k rows (for its interleaved rotary); qwen2 does not.
LLAMA_GGUF = GGUFNames(_LLAMA_GLOBAL, _LLAMA_BLOCK, {"self_attn.q_proj": "q", "self_attn.k_proj": "k"})
LLAMA_GGUF_UNPERMUTED = GGUFNames(_LLAMA_GLOBAL, _LLAMA_BLOCK)
QWEN3_GGUF = GGUFNames(_LLAMA_GLOBAL, {**_LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm",
                                       "attn_k_norm": "self_attn.k_norm"})

# Gemma 2/3: sandwich norms (llama.cpp's post_attention_norm / ffn_norm / post_ffw_norm), q/k norms (Gemma 3)
GEMMA_GGUF = GGUFNames(_LLAMA_GLOBAL, {**_LLAMA_BLOCK, "post_attention_norm": "post_attention_layernorm",
                                       "ffn_norm": "pre_feedforward_layernorm",
                                       "post_ffw_norm": "post_feedforward_layernorm",
                                       "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                       norm_shift=1.0)
# Phi-3: q|k|v and gate|up stay stacked (`attn_qkv`, `ffn_up`), split at load as from the HF checkpoint
PHI3_GGUF = GGUFNames(_LLAMA_GLOBAL, {**_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"})


@dataclass(frozen=True)
class ModelFamily:
    """How to build and fill one architecture. `model_class` is the class or "module:Class",
    imported on first build (keeps this module import-light); a family must be picklable,
    since tensor-parallel workers are spawned with it."""

    model_class: "type[nn.Module] | str"
    gguf: GGUFNames = LLAMA_GGUF_UNPERMUTED

    def resolve(self) -> "type[nn.Module]":
        if isinstance(self.model_class, str):
            module, _, name = self.model_class.partition(":")
            return getattr(importlib.import_module(module), name)
        return self.model_class

    def build(self, config: "ModelConfig", backend: "AttentionBackend") -> "nn.Module":
        return self.resolve()(config, backend)


_LLAMA = "kubeinfer.server.model.families.llama:LlamaForCausalLM"
_FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(_LLAMA, LLAMA_GGUF),
    "mistral": ModelFamily(_LLAMA),
    "qwen2": ModelFamily(_LLAMA),
    "qwen3": ModelFamily("kubeinfer.server.model.families.qwen3:Qwen3ForCausalLM", QWEN3_GGUF),
    "qwen3_moe": ModelFamily("kubeinfer.server.model.families.qwen3:Qwen3ForCausalLM", QWEN3_GGUF),
    "qwen3moe": ModelFamily("kubeinfer.server.model.families.qwen3:Qwen3ForCausalLM", QWEN3_GGUF),   # its GGUF name
    "mixtral": ModelFamily("kubeinfer.server.model.families.mixtral:MixtralForCausalLM"),
    "phi3": ModelFamily("kubeinfer.server.model.families.phi3:Phi3ForCausalLM", PHI3_GGUF),
    "gemma2": ModelFamily("kubeinfer.server.model.families.gemma:Gemma2ForCausalLM", GEMMA_GGUF),
    "gemma3_text": ModelFamily("kubeinfer.server.model.families.gemma:Gemma3ForCausalLM", GEMMA_GGUF),
}


def register_model(architecture: str, family: ModelFamily) -> None:
    """Serve checkpoints whose HF `model_type` / GGUF `general.architecture` is `architecture`."""
    _FAMILIES[architecture] = family


def model_family(architecture: str) -> ModelFamily:
    if architecture not in _FAMILIES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _FAMILIES[architecture]


def supported_architectures() -> tuple[str, ...]:
    return tuple(_FAMILIES)
