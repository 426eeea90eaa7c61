"""What a model source yields before the model is built: one shape for HF directories and GGUF files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .config import ModelConfig
from .tokenizer import Tokenizer

# Weights in transformers naming (`model.layers.0.self_attn.q_proj.weight`), converted to the given dtype.
WeightStream = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]

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
