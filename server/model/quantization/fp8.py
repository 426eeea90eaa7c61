"""`quant_method: fp8` checkpoints (AutoFP8 and vLLM's own FP8 export): float8 e4m3 `weight`
[N, K] with a per-tensor `weight_scale`, activations `dynamic` (one scale per input, computed at
run time) or `static` (the checkpoint's `input_scale`). Block-wise scales (`weight_block_size`,
DeepSeek / Qwen3 FP8) are refused, naming them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import QuantizationMethod, expect_shape
from .weights import Fp8Weight


class FP8CheckpointMethod(QuantizationMethod):
    name = "fp8"

    def __init__(self, config: dict[str, Any]) -> None:
        if config.get("weight_block_size"):
            raise ValueError(f"fp8 checkpoint: block-wise weight scales (weight_block_size "
                             f"{config['weight_block_size']}) are not supported")
        self.activations = config.get("activation_scheme", "dynamic")
        if self.activations not in ("dynamic", "static"):
            raise ValueError(f"fp8 checkpoint: activation_scheme {self.activations!r} is not supported")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint: fmt {config['fmt']!r} is not supported (e4m3 is)")
        self.ignored = list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])

    def layer_scheme(self, name: str, module: nn.Module) -> Any | None:
        if not name.startswith("model.layers.") or any(name == i or name.endswith(f".{i}") for i in self.ignored):
            return None
        return self.activations

    def tensor_suffixes(self, scheme: Any) -> tuple[str, ...]:
        return ("weight", "weight_scale") + (("input_scale",) if scheme == "static" else ())

    def build(self, name: str, scheme: Any, tensors: dict[str, torch.Tensor]) -> Fp8Weight:
        weight = tensors["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"quantized weight {name}.weight: expected float8_e4m3fn, got {weight.dtype}")
        scale = tensors["weight_scale"].float().reshape(-1)
        scale = scale.expand(weight.shape[0]).contiguous() if scale.numel() == 1 else scale
        expect_shape(f"{name}.weight_scale", scale, (weight.shape[0],))
        if scheme == "static":
            return Fp8Weight(weight, scale, "static", tensors["input_scale"].float().reshape(()))
        return Fp8Weight(weight, scale, "dynamic-tensor")
