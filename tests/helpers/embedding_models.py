"""Tiny random-weight embedding checkpoints (decoder embedders) and their sentence-level reference.

Two layouts a team meets: a causal-LM checkpoint with sentence-transformers files next to it
(Qwen3-Embedding: `Qwen3ForCausalLM` + modules.json + 1_Pooling), and the bare decoder saved by
itself (e5-mistral: `MistralModel`, tensors without the `model.` prefix, no LM head, no
sentence-transformers files: last-token pooling, normalised, as vLLM defaults).

The reference is transformers' own forward (`AutoModel`, float32) followed by the pooling written
out by hand as sentence-transformers does it (`models.Pooling`, `models.Normalize`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers.tiny_models import BOS_ID, EOS_ID, VOCAB_SIZE, _DIMS, _randomise, _write_tokenizer

ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def _config(kind: str, **extra: object):
    from transformers import MistralConfig, Qwen3Config

    common = dict(vocab_size=VOCAB_SIZE, num_key_value_heads=2, bos_token_id=BOS_ID, eos_token_id=EOS_ID, **_DIMS)
    if kind == "qwen3":
        return Qwen3Config(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           tie_word_embeddings=True, **common, **extra)
    return MistralConfig(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         **common, **extra)


def build_embedding_model(tmp_path: Path, *, kind: str = "qwen3", pooling: str | None = "last",
                          normalize: bool = True, bare: bool = False, seed: int = 0,
                          matryoshka_dimensions: list[int] | None = None,
                          name: str | None = None) -> tuple[Path, torch.nn.Module]:
    """Write a tiny embedding checkpoint; returns (directory, transformers decoder in float32).

    `pooling` None writes no sentence-transformers files; `bare` saves the decoder alone
    (`Qwen3Model` / `MistralModel`) instead of the causal LM."""
    from transformers import AutoModel, AutoModelForCausalLM

    path = Path(tmp_path) / (name or f"embed-{kind}-{pooling}-{'bare' if bare else 'lm'}")
    path.mkdir(parents=True, exist_ok=True)
    extra = {"matryoshka_dimensions": matryoshka_dimensions} if matryoshka_dimensions else {}
    config = _config(kind, **extra)
    torch.manual_seed(seed)
    model = (AutoModel if bare else AutoModelForCausalLM).from_config(config, dtype=torch.float32).eval()
    _randomise(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, add_bos_token=False)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        flags = {flag: flag == ST_MODES[pooling] for flag in ST_MODES.values()}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": config.hidden_size, **flags, "include_prompt": True}))
    decoder = model if bare else model.model
    return path, decoder


@torch.no_grad()
def reference_embedding(decoder: torch.nn.Module, ids: list[int], pooling: str = "last", normalize: bool = True,
                        dimensions: int | None = None) -> torch.Tensor:
    """sentence-transformers' embedding of one unpadded sequence: the decoder's last hidden
    states pooled, truncated (matryoshka), then L2-normalised."""
    hidden = decoder(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return torch.nn.functional.normalize(pooled, p=2, dim=-1) if normalize else pooled
