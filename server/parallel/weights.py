"""Sharded weight streams: each rank reads only its slice of every tensor.

safetensors slices straight from the file (`get_slice`). GGUF quantizes along rows, so a rank
dequantizes just its rows of column-parallel tensors; row-parallel tensors are dequantized
whole and sliced, one tensor at a time (`gguf_checkpoint.convert_tensor`, the single-device
loader's conversion). Vocab shards are zero-padded to equal size. A pipeline stage skips the
tensors of other stages' layers unread and gets its own under its local layer numbers
(`ShardPlan.local_name`); `slices` are keyed by the checkpoint's names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from safetensors import safe_open

from ..model.checkpoints.checkpoint import FusedParts, Slice, is_fused, split_fused
from ..model.checkpoints.gguf_checkpoint import convert_tensors
from ..model.checkpoints.gguf_reader import GGUFFile
from ..model.checkpoints.hf_checkpoint import _safetensors_files, _stored_as_is
from ..model.registry import GGUFNames
from .plan import ShardPlan


def safetensors_shards(path: Path, slices: Mapping[str, Slice], dtype: torch.dtype, fused: FusedParts,
                       keep_quantized: bool = False, local_name: Callable[[str], str | None] = str
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """`keep_quantized`: a quantized checkpoint's integer / 8-bit tensors and scales keep their
    dtype, as in the single-device loader (`hf_checkpoint._stored_as_is`)."""

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if keep_quantized and _stored_as_is(name, tensor) else tensor.to(dtype)

    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                local = local_name(name)
                if local is None:
                    continue
                if is_fused(name, fused):   # read whole, split, then each part sliced
                    for piece_name, piece in split_fused(name, handle.get_tensor(name), fused):
                        part = slices.get(piece_name)
                        if part is not None:
                            piece = part.pad(piece.narrow(part.dim, part.start, part.stop - part.start))
                        yield local_name(piece_name), convert(piece_name, piece)
                    continue
                part = slices.get(name)
                if part is None:
                    yield local, convert(name, handle.get_tensor(name))
                    continue
                view = handle.get_slice(name)
                tensor = view[part.start:part.stop] if part.dim == 0 else view[:, part.start:part.stop]
                yield local, part.pad(convert(name, tensor))


def gguf_shards(path: Path, plan: ShardPlan, slices: Mapping[str, Slice], names: GGUFNames, dtype: torch.dtype,
                fused: FusedParts) -> Iterator[tuple[str, torch.Tensor]]:
    for gguf_name, tensor in GGUFFile(path).tensors.items():
        experts = names.expert_names(gguf_name, tensor.shape[0]) if len(tensor.shape) == 3 else None
        if plan.local_name(experts[0] if experts else names.hf_name(gguf_name)) is None:
            continue
        # llama.cpp permutes rows within each head, so a rank's whole heads un-permute on their own.
        for name, converted in convert_tensors(names, gguf_name, tensor, dtype, plan.num_heads, plan.num_kv_heads,
                                               slices, fused):
            yield plan.local_name(name), converted


def sharded_weights(source: Path, plan: ShardPlan, slices: Mapping[str, Slice], names: GGUFNames,
                    dtype: torch.dtype, fused: FusedParts | None = None, keep_quantized: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of every checkpoint tensor; `slices` from `model.weight_slices`, `fused`
    from the family's `fused_checkpoint_parts` of the whole model's config."""
    if source.is_dir():
        return safetensors_shards(source, slices, dtype, fused or {}, keep_quantized, plan.local_name)
    return gguf_shards(source, plan, slices, names, dtype, fused or {})
