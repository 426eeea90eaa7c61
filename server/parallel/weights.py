"""Sharded weight streams: each rank reads only its slice of every tensor.

safetensors slices straight from the file (`get_slice`). GGUF quantizes along rows, so a rank
dequantizes just its rows of column-parallel tensors; row-parallel tensors are dequantized
whole and sliced, one tensor at a time (`gguf_checkpoint.convert_tensor`, the single-device
loader's conversion). Vocab shards are zero-padded to equal size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import safe_open

from ..model.checkpoint import Slice
from ..model.gguf_checkpoint import convert_tensor
from ..model.gguf_reader import GGUFFile
from ..model.hf_checkpoint import _safetensors_files
from ..model.registry import GGUFNames
from .plan import ShardPlan


def safetensors_shards(path: Path, slices: Mapping[str, Slice], dtype: torch.dtype
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                part = slices.get(name)
                if part is None:
                    yield name, handle.get_tensor(name).to(dtype)
                    continue
                view = handle.get_slice(name)
                tensor = view[part.start:part.stop] if part.dim == 0 else view[:, part.start:part.stop]
                yield name, part.pad(tensor.to(dtype))


def gguf_shards(path: Path, plan: ShardPlan, slices: Mapping[str, Slice], names: GGUFNames, dtype: torch.dtype
                ) -> Iterator[tuple[str, torch.Tensor]]:
    for gguf_name, tensor in GGUFFile(path).tensors.items():
        # llama.cpp permutes rows within each head, so a rank's whole heads un-permute on their own.
        yield convert_tensor(names, gguf_name, tensor, dtype, plan.num_heads, plan.num_kv_heads,
                             slices.get(names.hf_name(gguf_name)))


def sharded_weights(source: Path, plan: ShardPlan, slices: Mapping[str, Slice], names: GGUFNames,
                    dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of every checkpoint tensor; `slices` from `model.weight_slices`."""
    if source.is_dir():
        return safetensors_shards(source, slices, dtype)
    return gguf_shards(source, plan, slices, names, dtype)
