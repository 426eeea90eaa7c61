"""What a model source yields before the model is built: one shape for HF directories and GGUF files."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .config import ModelConfig
from .tokenizer import Tokenizer

# Weights in transformers naming (`model.layers.0.self_attn.q_proj.weight`), converted to the given dtype.
WeightStream = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]
# transformers name -> (GGUF type name, raw blocks uint8 [rows, blocks per row, block bytes])
QuantizedBlocks = dict[str, tuple[str, torch.Tensor]]

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
    # GGUF matrices in a type the CPU quantized-linear kernel reads, filled as `weights` streams
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


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread. NOTE: every parallel op ends in a thread barrier;
    on small tensors that costs more than it saves, and on an oversubscribed host each barrier
    can wait a whole scheduler slice (oneDNN's weight prepack: ~8 ms a matrix with 2 threads on
    our busy 2-core box, 0.5-1.3 ms with one)."""
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
