"""Write a tiny HF Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3 or Phi-3 as a GGUF the way llama.cpp's
converter does (for `llama`: q/k rows permuted for its rotary layout, Llama-3 rope scaling baked into `rope_freqs`;
Gemma: 1 added to every norm weight, sandwich norms as post_attention_norm / ffn_norm / post_ffw_norm, soft-caps,
window and global-layer pattern in the metadata; Phi-3: q|k|v and gate|up kept stacked as attn_qkv / ffn_up),
Q8_0-quantized.

Q8_0 blocks run along rows and the permutation only reorders rows, so quantization commutes with
it: the exporter also returns the transformers model with the same quantization round-trip applied,
the exact reference the GGUF must reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType, GGUFWriter, quants

_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.experts.down_proj": "ffn_down_exps", "mlp.experts.gate_up_proj": "ffn_gate_up_exps"}
# llama.cpp's architecture names: Mixtral is written as `llama` with experts
_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "gemma3_text": "gemma3"}
_GEMMA_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_BLOCK_BY_ARCH = {"gemma2": _GEMMA_BLOCK, "gemma3": _GEMMA_BLOCK,
                  "phi3": {**_BLOCK, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}}


def _gguf_name(name: str, arch: str = "llama") -> str:
    if name in _NAMES:
        return _NAMES[name]
    block = _BLOCK_BY_ARCH.get(arch, _BLOCK)
    _, _, layer, *module, kind = name.split(".")
    module = ".".join(module)
    return f"blk.{layer}.{block[module]}.{kind}" if module in block else f"blk.{layer}.{block[f'{module}.{kind}']}.weight"


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def export_gguf(hf_dir: Path, hf_model: torch.nn.Module, out: Path,
                qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0, pooling_type: int | None = None
                ) -> torch.nn.Module:
    """Write `out` and return `hf_model` with matrices replaced by their quantize/dequantize round-trip.
    `pooling_type`: llama.cpp's `<arch>.pooling_type` of an embedding model (1 mean, 2 cls, 3 last)."""
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch = _ARCHITECTURES.get(config.model_type, config.model_type)
    writer = GGUFWriter(out, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:   # stacked ffn_{gate,up,down}_exps [E, rows, cols] and the router ffn_gate_inp
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)   # Gemma 3: the global layers' rope (llama.cpp knows the local base)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":   # every n-th layer global
        writer.add_sliding_window_pattern(config.layer_types.index("full_attention") + 1)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, cap, None) is not None:
            getattr(writer, f"add_{cap}")(getattr(config, cap))
    _add_tokenizer(writer, hf_dir)
    with torch.no_grad():
        if rope.get("rope_type") == "llama3":   # llama.cpp stores default_inv_freq / scaled_inv_freq
            scaled = hf_model.model.rotary_emb.inv_freq.float()
            default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
            writer.add_tensor("rope_freqs.weight", (default / scaled).numpy())
        # llama.cpp permutes only `llama` q/k (Qwen2 uses its NeoX rotary, the HF layout)
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads} \
            if arch == "llama" else {}
        for name, param in hf_model.state_dict().items():
            if name == "lm_head.weight" and arch.startswith("gemma"):   # tied: llama.cpp writes no output.weight
                continue
            gguf_name = _gguf_name(name, arch)
            value = param.float().numpy()
            if arch.startswith("gemma") and name.endswith("norm.weight"):   # llama.cpp's norms scale by w
                value = value + 1.0
            raw_dtype = None
            if value.ndim >= 2 and value.shape[-1] % 32 == 0 and qtype != GGMLQuantizationType.F32:
                value, raw_dtype = quants.quantize(value, qtype), qtype   # along rows: slicing rows commutes
                param.copy_(torch.from_numpy(quants.dequantize(value, qtype)))
            kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
            if kind in heads:
                value = _llama_cpp_permute(value, heads[kind])
            if name.endswith("mlp.experts.gate_up_proj"):   # transformers 5 stacks gate|up; llama.cpp keeps two
                rows = value.shape[1] // 2
                writer.add_tensor(gguf_name.replace("ffn_gate_up_exps", "ffn_gate_exps"), value[:, :rows], raw_dtype=raw_dtype)
                writer.add_tensor(gguf_name.replace("ffn_gate_up_exps", "ffn_up_exps"), value[:, rows:], raw_dtype=raw_dtype)
                continue
            writer.add_tensor(gguf_name, value, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_model


def _add_tokenizer(writer: GGUFWriter, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {token["id"] for token in spec["added_tokens"] if token["special"]}
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if index in special else 1 for index in range(len(tokens))])
    writer.add_token_merges(merges)
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])
