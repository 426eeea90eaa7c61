"""`--quantization fp8|int8` on an unquantized checkpoint (or a GGUF file's dequantized weights):
the linear layers quantized at load, as vLLM's `--quantization fp8` does."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import QuantizationMethod
from .weights import QuantizedLinearWeight, quantize_per_channel


class DenseAtLoad(QuantizationMethod):
    """`--quantization fp8|int8` on an unquantized checkpoint: every linear layer of the decoder
    (not the lm_head, as vLLM) quantized per output channel, activations dynamic per token."""

    dense_checkpoint = True

    def __init__(self, kind: str) -> None:
        self.name = kind

    def layer_scheme(self, name: str, module: nn.Module) -> Any | None:
        return self.name if name.startswith("model.layers.") else None

    def tensor_suffixes(self, scheme: Any) -> tuple[str, ...]:
        return ("weight",)

    def build(self, name: str, scheme: Any, tensors: dict[str, torch.Tensor]) -> QuantizedLinearWeight:
        return quantize_per_channel(tensors["weight"], self.name)
