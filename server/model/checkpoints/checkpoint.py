"""What a model source yields before the model is built: one shape for HF directories and GGUF files."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..config import ModelConfig
from ..tokenizer.tokenizer import Tokenizer

# Weights in transformers naming (`model.layers.0.self_attn.q_proj.weight`), converted to the given dtype.
WeightStream = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]
# transformers name -> (GGUF type name, raw blocks uint8 [rows, blocks per row, block bytes])
QuantizedBlocks = dict[str, tuple[str, torch.Tensor]]
# A checkpoint matrix that stacks several projections (Phi-3's `self_attn.qkv_proj`), by its module
# name inside a layer -> each part's module name and rows, in order
FusedParts = dict[str, list[tuple[str, int]]]

PARALLEL_MIN_NUMEL = 1 << 24   # tensors smaller than this load on one intra-op thread

GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_tokens")


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    generation_defaults: dict
    name: str
    num_tensors: int
    weights: WeightStream
    # GGUF matrices in a type the CPU's GGUF kernel reads, filled as `weights` streams (`quantization/gguf.py`)
    quantized: QuantizedBlocks = field(default_factory=dict)
    # a HF checkpoint's config.json `quantization_config` (see quantization/)
    quantization_config: dict | None = None
    gguf: bool = False   # a GGUF file: its tensor types are its quantization


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor a tensor-parallel rank loads."""

    dim: int        # 0 = rows (output features), 1 = columns (input features)
    start: int
    stop: int
    padded: int     # rows the rank's parameter has (vocab shards are padded to equal size)

    def pad(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (this slice of the checkpoint tensor) zero-padded to `padded` rows."""
        missing = self.padded - tensor.shape[0] if self.dim == 0 else 0
        return tensor if missing == 0 else torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])


def _fused_parts(name: str, fused: FusedParts) -> tuple[str, str, list[tuple[str, int]]] | None:
    """(layer prefix, weight or bias, parts) when checkpoint tensor `name` is a fused one."""
    module, _, kind = name.rpartition(".")
    layer, _, leaf = module.rpartition(".")
    prefix, _, parent = layer.rpartition(".")
    parts = fused.get(f"{parent}.{leaf}")
    return None if parts is None else (prefix, kind, parts)


def is_fused(name: str, fused: FusedParts) -> bool:
    return _fused_parts(name, fused) is not None


def split_fused(name: str, tensor: torch.Tensor, fused: FusedParts) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint tensor `name` as its parts' tensors when it is a fused one, else as itself:
    `model.layers.0.self_attn.qkv_proj.weight` -> `...q_proj.weight`, `...k_proj.weight`, ..."""
    found = _fused_parts(name, fused)
    if found is None:
        return [(name, tensor)]
    prefix, kind, parts = found
    pieces = tensor.split([rows for _, rows in parts], dim=0)
    return [(f"{prefix}.{part}.{kind}", piece) for (part, _), piece in zip(parts, pieces, strict=True)]


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread. NOTE: every parallel op ends in a thread barrier;
    on small tensors that costs more than it saves, and on an oversubscribed host each barrier
    can wait a whole scheduler slice (oneDNN's weight prepack, several times slower with 2
    threads than with one on a busy 2-core box: BENCHMARKS.md, "Figures that were in code
    comments")."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def loading_threads(numel: int) -> Iterator[None]:
    """One intra-op thread while a small tensor is converted and copied in (see `one_intra_op_thread`).
    Loading the embedded model on our shared 2-core box (load average ~15): 34 s with 2 threads
    throughout, 2-3 s with this. Weight streams yield inside this context, so the consumer's copy
    runs under it too."""
    if numel >= PARALLEL_MIN_NUMEL:
        yield
        return
    with one_intra_op_thread():
        yield
