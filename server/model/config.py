"""Architecture hyper-parameters of a Llama-family decoder, from HF `config.json` or GGUF metadata.

Both sources land in one validated dataclass so the model code never guesses: Llama 2/3,
SmolLM2, Mistral and Qwen2/2.5 differ only in the fields below (biases, tying, rope scaling);
mixture-of-experts families (Mixtral, Qwen3-MoE) add `MoEConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .registry import supported_architectures

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "freq_factors")


@dataclass(frozen=True)
class MoEConfig:
    """Top-k routed experts in place of the dense MLP (Mixtral, Qwen3-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int               # of each expert
    renormalize: bool                    # top-k weights rescaled to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    dense_layers: frozenset[int] = frozenset()   # layers that keep the dense MLP (Qwen3-MoE's mlp_only_layers)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.top_k}) must be between 1 and the "
                             f"number of experts ({self.num_experts})")
        if self.intermediate_size <= 0:
            raise ValueError(f"model config: the expert intermediate size must be positive, got {self.intermediate_size}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "MoEConfig | None":
        """transformers' keys (`num_local_experts` for Mixtral, `num_experts` for Qwen3-MoE); None
        for a dense model."""
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        if not experts:
            return None
        for unsupported in ("shared_expert_intermediate_size", "n_shared_experts"):
            if config.get(unsupported):
                raise ValueError(f"model config: shared experts ({unsupported}) are not supported")
        layers = config["num_hidden_layers"]
        step = config.get("decoder_sparse_step") or 1
        dense = {i for i in range(layers) if i in set(config.get("mlp_only_layers") or []) or (i + 1) % step}
        return cls(num_experts=experts, top_k=config["num_experts_per_tok"],
                   intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
                   renormalize=bool(config.get("norm_topk_prob", True)), dense_layers=frozenset(dense))


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    # per layer "sliding_attention" / "full_attention" where they differ (Gemma); () = all alike
    layer_types: tuple[str, ...] = ()
    moe: MoEConfig | None = None
    # Gemma: attention scale 1/sqrt(query_pre_attn_scalar), soft-caps, the local layers' rope base
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.architecture not in supported_architectures():
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(supported_architectures())}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        self.eos_token_ids = frozenset(self.eos_token_ids)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "ModelConfig":
        """From a parsed `config.json`: both the classic keys (`rope_theta`, `rope_scaling`) and
        transformers>=5's `rope_parameters`."""
        model_type = config.get("model_type", "")
        heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        local_rope = {"rope_theta": config["rope_local_base_freq"]} if "rope_local_base_freq" in config else None
        if "full_attention" in rope:   # Gemma 3 (transformers 5): one rope per layer type
            local_rope, rope = dict(rope.get("sliding_attention") or {}), dict(rope["full_attention"])
        if local_rope and local_rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling type {local_rope['rope_type']!r} on sliding-window layers")
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        if "type" in rope:   # pre-4.45 spelling
            rope.setdefault("rope_type", rope.pop("type"))
        partial_rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial_rotary != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor {partial_rotary}) are not supported")
        rope.pop("partial_rotary_factor", None)
        if rope.get("rope_type") == "su":   # Phi-3's first spelling of longrope
            rope["rope_type"] = "longrope"
        if rope.get("rope_type") in ("yarn", "longrope"):
            rope.setdefault("original_max_position_embeddings", config.get("original_max_position_embeddings")
                            or config.get("max_position_embeddings", 4096))
        if rope.get("rope_type") == "longrope" and rope.get("factor") is None:   # as transformers derives it
            rope["factor"] = config.get("max_position_embeddings", 4096) / rope["original_max_position_embeddings"]
        max_positions = config.get("max_position_embeddings", 4096)
        if rope.get("rope_type") == "dynamic":   # trained on max_position_embeddings, served up to factor times it (vLLM)
            rope["original_max_position_embeddings"] = max_positions
            max_positions = int(max_positions * rope["factor"])
        eos = config.get("eos_token_id")
        layer_types = tuple(config.get("layer_types") or _gemma_layer_types(model_type, config))
        use_sliding = config.get("use_sliding_window",
                                 model_type in ("mistral", "phi3") or "sliding_attention" in layer_types)
        if model_type.startswith("qwen") and use_sliding:
            raise ValueError("models that mix sliding-window and full-attention layers are not supported")
        return cls(
            architecture=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=max_positions,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            sliding_window=config.get("sliding_window") if use_sliding else None,
            layer_types=layer_types if len(set(layer_types)) > 1 else (),
            moe=MoEConfig.from_hf(config),
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            rope_local_theta=float(local_rope.get("rope_theta", 10000.0)) if local_rope is not None else None,
            hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "silu",
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensor_names: set[str]) -> "ModelConfig":
        """From GGUF metadata (`<arch>.*` keys, as llama.cpp's converter writes them)."""
        arch = meta["general.architecture"]
        ours = _GGUF_ARCHITECTURES.get(arch, arch)
        if ours not in supported_architectures():
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(supported_architectures())}")
        if "rope_factors_long.weight" in tensor_names:
            raise ValueError("GGUF LongRoPE factors (rope_factors_long / rope_factors_short, Phi-3 128k / Phi-3.5) "
                             "are not supported yet; load this model from its Hugging Face directory")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden, heads = key("embedding_length"), key("attention.head_count")
        vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        rope_scaling = None
        scaling_type = key("rope.scaling.type")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
        elif scaling_type not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")
        if "rope_freqs.weight" in tensor_names:
            # Llama 3.1+: the converter bakes the llama3 scaling into a per-frequency divisor tensor,
            # which the model loads into its rotary embedding.
            rope_scaling = {"rope_type": "freq_factors"}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        blocks = int(key("block_count"))
        moe = None
        if key("expert_count"):   # Mixtral (as `llama`), qwen3moe: stacked ffn_*_exps tensors
            moe = MoEConfig(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                            intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length")),
                            renormalize=bool(key("expert_weights_norm", True)),   # what llama.cpp does for both
                            dense_layers=frozenset(i for i in range(blocks)
                                                   if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names))
        head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads)
        gemma = _gemma_from_gguf(ours, key, blocks, int(hidden), int(heads), head_dim) if ours.startswith("gemma") else {}
        return cls(
            architecture=ours,
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=blocks,
            num_attention_heads=int(heads),
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            sliding_window=key("attention.sliding_window"),
            moe=moe,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=frozenset([] if eos is None else [int(eos)]),
            **gemma,
        )


# llama.cpp's architecture names that differ from transformers' model_type
_GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
# llama.cpp's Gemma rules for what its GGUF does not carry: the layer count of the 27B models (whose
# attention scale is 1/sqrt(hidden / heads), the others' 1/sqrt(head_dim)), every n-th layer global
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6}


def _gemma_from_gguf(arch: str, key: Any, blocks: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2/3's fields from GGUF metadata, completed as llama.cpp completes them."""
    scale = key("attention.scale")
    scalar = 1.0 / scale ** 2 if scale else hidden / heads if blocks == _GEMMA_27B_LAYERS[arch] else head_dim
    pattern = key("attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[arch])
    if isinstance(pattern, list):   # per layer: True = sliding
        local = [bool(flag) for flag in pattern]
    else:   # llama.cpp's set_swa_pattern(n): the last layer of every n is global
        local = [i % int(pattern) < int(pattern) - 1 for i in range(blocks)]
    return {"query_pre_attn_scalar": float(scalar), "hidden_act": "gelu_pytorch_tanh",
            "attn_logit_softcapping": key("attn_logit_softcapping"),
            "final_logit_softcapping": key("final_logit_softcapping"),
            "layer_types": tuple("sliding_attention" if flag else "full_attention" for flag in local)
            if key("attention.sliding_window") and len(set(local)) > 1 else (),
            "rope_local_theta": float(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3_text" else None}


def _gemma_layer_types(model_type: str, config: Mapping[str, Any]) -> list[str]:
    """Hub configs of Gemma 2/3 written before transformers had `layer_types`: every
    `sliding_window_pattern`-th layer global (Gemma 2: every second), the others local."""
    pattern = {"gemma2": 2, "gemma3_text": config.get("sliding_window_pattern", 6)}.get(model_type)
    if pattern is None:
        return []
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config["num_hidden_layers"])]
