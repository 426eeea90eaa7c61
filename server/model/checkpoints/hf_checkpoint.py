"""Read a Hugging Face model directory: config.json, *.safetensors (sharded or not), tokenizer files,
generation_config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ...weights.prefetch import prefetch
from ..config import ModelConfig
from ..quantization import QUANTIZED_TENSOR_SUFFIXES
from ..registry import model_family
from . import safetensors_stream
from .checkpoint import GENERATION_KEYS, Checkpoint, loading_threads, split_fused
from .tokenizer_files import hf_tokenizer, read_json


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(read_json(index)["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _eos_ids(*values: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in values:
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(ids)


def read_hf_directory(path: Path) -> Checkpoint:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
    hf_config = read_json(path / "config.json")
    generation = read_json(path / "generation_config.json")
    config = ModelConfig.from_hf(hf_config)
    config.eos_token_ids = _eos_ids(hf_config.get("eos_token_id"), generation.get("eos_token_id"))
    tokenizer = hf_tokenizer(path, config.eos_token_ids)
    defaults = {("max_tokens" if key == "max_new_tokens" else key): value for key, value in generation.items()}
    files = _safetensors_files(path)
    fused = model_family(config.architecture).resolve().fused_checkpoint_parts(config)

    quantization_config = hf_config.get("quantization_config")

    def weights(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        prefetch(path)   # the disk reads ahead while tensors are copied (a no-op if `serve` started it)
        for file in files:   # views of the file's pages: the consumer's copy is the only one
            for name, tensor in safetensors_stream.tensors(file):
                with loading_threads(tensor.numel()):
                    tensor = tensor if quantization_config and _stored_as_is(name, tensor) else tensor.to(dtype)
                    yield from split_fused(name, tensor, fused)

    num_tensors = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            num_tensors += len(handle.keys())
    return Checkpoint(config=config, tokenizer=tokenizer,
                      generation_defaults={k: v for k, v in defaults.items() if k in GENERATION_KEYS},
                      name=path.resolve().name, num_tensors=num_tensors, weights=weights,
                      quantization_config=quantization_config)


def _stored_as_is(name: str, tensor: torch.Tensor) -> bool:
    """Quantized weights (integers, 8-bit floats) and their scales and zero points reach the
    quantized layer in the checkpoint's dtypes: a scale rounded to bf16 would shift every weight."""
    return (not tensor.is_floating_point() or tensor.element_size() == 1
            or name.rpartition(".")[2] in QUANTIZED_TENSOR_SUFFIXES)
