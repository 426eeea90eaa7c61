"""Tiny random-weight Hugging Face models written to disk, for parity tests without a model hub.

Each builder writes a complete HF directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat_template, generation_config.json) in well under a
second. Every parameter is randomised with a seeded generator, including norm weights and
Qwen2's q/k/v biases (transformers initialises those to 1 and 0, which would hide loader bugs
such as a missing bias or a swapped norm). The byte-level BPE tokenizer is trained once per
process on a fixed corpus: ~384 tokens, so any UTF-8 text round-trips.

    from helpers.tiny_models import make_tiny_llama, build_tiny_qwen2
    path = make_tiny_llama(tmp_path, tie_word_embeddings=True)
    path, hf_model = build_tiny_qwen2(tmp_path)      # also returns the transformers model (fp32, eval)

Builders: Llama (tied or not, llama3 rope scaling), Qwen2 (q/k/v bias), Mistral (sliding window),
Qwen3 (q/k norms, head_dim apart from hidden / heads), Mixtral and Qwen3-MoE (4 experts, top-2),
Gemma 2 / Gemma 3 (a local layer with a window of 8, a global one; soft-caps that bite), Phi-3
(fused qkv_proj / gate_up_proj checkpoint matrices, window 8).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
BOS_ID, EOS_ID = 1, 2
VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time there was a tiny model that answered every question with numbers 0123456789.",
    "def main():\n    return [x * 2 for x in range(10)]\n",
    "Kubernetes schedules pods; the engine batches tokens; the cache shares prefixes.",
    "Hello, world! How are you today? I am fine, thank you.",
]
_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=4096, rms_norm_eps=1e-6)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer_json(add_bos_token: bool = False) -> str:
    """A byte-level BPE (GPT-2 style, like SmolLM2/Qwen2) trained on a fixed corpus; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    if add_bos_token:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer.to_str()


def _write_tokenizer(path: Path, add_bos_token: bool) -> None:
    (path / "tokenizer.json").write_text(tiny_tokenizer_json(add_bos_token))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN, "unk_token": None, "add_bos_token": add_bos_token, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _randomise(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Seeded random values for every parameter: norms around 1, biases and weights around 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(std * noise)


def _build(tmp_path: Path, config: Any, seed: int, add_bos_token: bool,
           generation_config: dict | None, name: str) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    path = Path(tmp_path) / name
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomise(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, **(generation_config or {})}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(path, add_bos_token)
    return path, model


def build_tiny_llama(tmp_path: Path, *, tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                     num_kv_heads: int = 2, seed: int = 0, add_bos_token: bool = False,
                     generation_config: dict | None = None, hidden_act: str = "silu",
                     max_position_embeddings: int = 4096,
                     name: str = "tiny-llama") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Llama (GQA 4 heads / `num_kv_heads`, head_dim 16) and its transformers model."""
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    config = LlamaConfig(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, rope_parameters=rope,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         hidden_act=hidden_act, **{**_DIMS, "max_position_embeddings": max_position_embeddings})
    return _build(tmp_path, config, seed, add_bos_token, generation_config, name)


def build_tiny_qwen2(tmp_path: Path, *, tie_word_embeddings: bool = False, num_kv_heads: int = 2, seed: int = 0,
                     add_bos_token: bool = False, generation_config: dict | None = None,
                     name: str = "tiny-qwen2") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Qwen2 (q/k/v biases, GQA) and its transformers model."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         **_DIMS)
    return _build(tmp_path, config, seed, add_bos_token, generation_config, name)


def build_tiny_mistral(tmp_path: Path, *, sliding_window: int = 8, num_kv_heads: int = 2, seed: int = 0,
                       name: str = "tiny-mistral") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Mistral with a small sliding window (to exercise windowed attention) and its transformers model."""
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, sliding_window=sliding_window,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           bos_token_id=BOS_ID, eos_token_id=EOS_ID, **_DIMS)
    return _build(tmp_path, config, seed, False, None, name)


def build_tiny_qwen3(tmp_path: Path, *, tie_word_embeddings: bool = False, num_kv_heads: int = 2, seed: int = 0,
                     rope_scaling: dict | None = None, name: str = "tiny-qwen3") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Qwen3: q/k RMS norms, no q/k/v bias, head_dim 32 (4 heads x 32 = 128 != hidden 64)."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, head_dim=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, **(rope_scaling or {})},
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                         **_DIMS)
    return _build(tmp_path, config, seed, False, None, name)


def build_tiny_mixtral(tmp_path: Path, *, tie_word_embeddings: bool = False, num_kv_heads: int = 2, seed: int = 0,
                       name: str = "tiny-mixtral") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Mixtral: 4 SwiGLU experts of 96 units in every layer, top-2, re-normalised."""
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, num_local_experts=4,
                           num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID, **{**_DIMS, "intermediate_size": 96})
    return _build(tmp_path, config, seed, False, None, name)


def build_tiny_qwen3_moe(tmp_path: Path, *, tie_word_embeddings: bool = False, num_kv_heads: int = 2, seed: int = 0,
                         norm_topk_prob: bool = True,
                         name: str = "tiny-qwen3-moe") -> tuple[Path, torch.nn.Module]:
    """A 3-layer Qwen3-MoE: layers 0 and 2 with 4 experts of 48 units (top-2), layer 1 dense
    (`mlp_only_layers`), q/k norms, head_dim 32."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, head_dim=32, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=norm_topk_prob,
                            decoder_sparse_step=1, mlp_only_layers=[1],
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                            tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                            **{**_DIMS, "num_hidden_layers": 3})
    return _build(tmp_path, config, seed, False, None, name)


def build_tiny_gemma2(tmp_path: Path, *, tie_word_embeddings: bool = True, num_kv_heads: int = 2, seed: int = 0,
                      name: str = "tiny-gemma2") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Gemma 2: layer 0 local (window 8, shorter than the test prompts), layer 1 global;
    score soft-cap 1.0 and logit soft-cap 3.0 (small enough to change these random models'
    outputs), query_pre_attn_scalar 24 != head_dim 16."""
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, head_dim=16, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                          attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                          pad_token_id=0, **_DIMS)
    return _build(tmp_path, config, seed, False, None, name)


def build_tiny_gemma3(tmp_path: Path, *, tie_word_embeddings: bool = True, num_kv_heads: int = 2, seed: int = 0,
                      name: str = "tiny-gemma3") -> tuple[Path, torch.nn.Module]:
    """A 3-layer Gemma 3 text model: local, local, global (window 8); q/k norms; local rope base
    10000, global 1e6 with linear scaling (factor 2)."""
    from transformers import Gemma3TextConfig

    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    config = Gemma3TextConfig(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              query_pre_attn_scalar=16, rope_parameters=rope,
                              tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                              pad_token_id=0, **{**_DIMS, "num_hidden_layers": 3})
    return _build(tmp_path, config, seed, False, None, name)


def build_tiny_phi3(tmp_path: Path, *, tie_word_embeddings: bool = False, num_kv_heads: int = 2, seed: int = 0,
                    sliding_window: int | None = 8, rope_scaling: dict | None = None,
                    name: str = "tiny-phi3") -> tuple[Path, torch.nn.Module]:
    """A 2-layer Phi-3: its checkpoint stacks q|k|v and gate|up; a sliding window of 8 as
    Phi-3-mini-4k has one (2047)."""
    from transformers import Phi3Config

    config = Phi3Config(vocab_size=VOCAB_SIZE, num_key_value_heads=num_kv_heads, sliding_window=sliding_window,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})},
                        tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                        pad_token_id=0, **_DIMS)
    return _build(tmp_path, config, seed, False, None, name)


def make_tiny_llama(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Llama HF directory; keyword arguments as `build_tiny_llama`."""
    return build_tiny_llama(tmp_path, **kwargs)[0]


def make_tiny_qwen2(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Qwen2 HF directory; keyword arguments as `build_tiny_qwen2`."""
    return build_tiny_qwen2(tmp_path, **kwargs)[0]


def make_tiny_qwen3(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Qwen3 HF directory; keyword arguments as `build_tiny_qwen3`."""
    return build_tiny_qwen3(tmp_path, **kwargs)[0]


def make_tiny_mixtral(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Mixtral HF directory; keyword arguments as `build_tiny_mixtral`."""
    return build_tiny_mixtral(tmp_path, **kwargs)[0]


def make_tiny_qwen3_moe(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Qwen3-MoE HF directory; keyword arguments as `build_tiny_qwen3_moe`."""
    return build_tiny_qwen3_moe(tmp_path, **kwargs)[0]


def make_tiny_gemma2(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Gemma 2 HF directory; keyword arguments as `build_tiny_gemma2`."""
    return build_tiny_gemma2(tmp_path, **kwargs)[0]


def make_tiny_gemma3(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Gemma 3 text HF directory; keyword arguments as `build_tiny_gemma3`."""
    return build_tiny_gemma3(tmp_path, **kwargs)[0]


def make_tiny_phi3(tmp_path: Path, **kwargs: Any) -> Path:
    """Path of a tiny Phi-3 HF directory; keyword arguments as `build_tiny_phi3`."""
    return build_tiny_phi3(tmp_path, **kwargs)[0]


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The reference transformers model for a directory written above (eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
