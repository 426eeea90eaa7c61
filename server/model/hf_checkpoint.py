"""Read a Hugging Face model directory: config.json, *.safetensors (sharded or not), tokenizer files,
generation_config.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as BackendTokenizer

from .checkpoint import GENERATION_KEYS, Checkpoint, loading_threads
from .config import ModelConfig
from .tokenizer import Tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(_read_json(index)["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = tokenizer_config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):   # named templates: the default one serves chat
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _eos_ids(*values: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in values:
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(ids)


def read_hf_directory(path: Path) -> Checkpoint:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (the fast-tokenizer file is required)")
    hf_config = _read_json(path / "config.json")
    generation = _read_json(path / "generation_config.json")
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    config = ModelConfig.from_hf(hf_config)
    config.eos_token_ids = _eos_ids(hf_config.get("eos_token_id"), generation.get("eos_token_id"))
    tokenizer = Tokenizer(
        BackendTokenizer.from_file(str(path / "tokenizer.json")),
        chat_template=_chat_template(path, tokenizer_config),
        bos_token=_token_text(tokenizer_config.get("bos_token")),
        eos_token=_token_text(tokenizer_config.get("eos_token")),
        eos_token_ids=config.eos_token_ids,
        extra_special_tokens={name: _token_text(tokenizer_config.get(name)) for name in ("unk_token", "pad_token")},
    )
    defaults = {("max_tokens" if key == "max_new_tokens" else key): value for key, value in generation.items()}
    files = _safetensors_files(path)

    def weights(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    with loading_threads(math.prod(tensor.get_shape())):
                        yield name, handle.get_tensor(name).to(dtype)

    num_tensors = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            num_tensors += len(handle.keys())
    return Checkpoint(config=config, tokenizer=tokenizer,
                      generation_defaults={k: v for k, v in defaults.items() if k in GENERATION_KEYS},
                      name=path.resolve().name, num_tensors=num_tensors, weights=weights)
