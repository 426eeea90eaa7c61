"""Sharded weight streams: each rank reads only its slice of every tensor.

safetensors slices straight from the file (`get_slice`). GGUF quantizes along rows, so a rank
dequantizes just its rows of column-parallel tensors; row-parallel tensors (o_proj, down_proj)
are dequantized whole and sliced, one tensor at a time. Vocab shards are zero-padded to equal size.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from ..model.config import ModelConfig
from ..model.gguf_checkpoint import hf_name, unpermute_rope_rows
from ..model.gguf_dequant import dequantize
from ..model.gguf_reader import GGUFFile
from ..model.hf_checkpoint import _safetensors_files
from .plan import ShardPlan, Slice


def _pad_rows(tensor: torch.Tensor, part: Slice) -> torch.Tensor:
    missing = part.padded - tensor.shape[0] if part.dim == 0 else 0
    return tensor if missing == 0 else torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])


def safetensors_shards(path: Path, plan: ShardPlan, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                part = plan.slice_for(name)
                if part is None:
                    yield name, handle.get_tensor(name).to(dtype)
                    continue
                view = handle.get_slice(name)
                tensor = view[part.start:part.stop] if part.dim == 0 else view[:, part.start:part.stop]
                yield name, _pad_rows(tensor.to(dtype), part)


def gguf_shards(path: Path, plan: ShardPlan, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    config: ModelConfig = plan.config
    permuted_heads = {"self_attn.q_proj": plan.num_heads, "self_attn.k_proj": plan.num_kv_heads}
    for gguf_name, tensor in GGUFFile(path).tensors.items():
        name = hf_name(gguf_name)
        target = torch.float32 if name == "rope_freqs.weight" else dtype
        part = plan.slice_for(name)
        if part is None:
            value = dequantize(tensor, target)
        elif part.dim == 0 and len(tensor.shape) == 2:   # whole quantized rows: dequantize only ours
            rows = dataclasses.replace(tensor, shape=(part.stop - part.start, tensor.shape[1]),
                                       data=tensor.data[part.start:part.stop])
            value = _pad_rows(dequantize(rows, target), part)
        else:
            full = dequantize(tensor, target)
            value = _pad_rows(full.narrow(part.dim, part.start, part.stop - part.start).clone(), part)
        module = name.rpartition(".")[0].split(".", 3)[-1]
        if config.architecture == "llama" and module in permuted_heads:
            # llama.cpp permutes rows within each head, so a rank's whole heads un-permute on their own.
            value = unpermute_rope_rows(value, permuted_heads[module])
        yield name, value


def sharded_weights(source: Path, plan: ShardPlan, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    if source.is_dir():
        return safetensors_shards(source, plan, dtype)
    return gguf_shards(source, plan, dtype)
