"""Which quantization method a load uses: the checkpoint's own (config.json's
`quantization_config`, a GGUF file's tensor types) and the `--quantization` flag, or a refusal of
the two together."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...flags import QUANTIZATION_METHODS
from .at_load import DenseAtLoad
from .base import QuantizationMethod

if TYPE_CHECKING:
    from ..checkpoints.checkpoint import Checkpoint

# config.json `quant_method`s read (fp8: AutoFP8 / vLLM's FP8 export)
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")


def resolve(quantization_config: dict[str, Any] | None, requested: str) -> QuantizationMethod | None:
    """The method for a HF checkpoint's `quantization_config` and the `--quantization` flag:
    'auto' follows the checkpoint, 'none' is only for unquantized checkpoints and GGUF, a named
    method must agree with the checkpoint's own."""
    checkpoint_method = (quantization_config or {}).get("quant_method")
    if quantization_config is not None and checkpoint_method not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization method {checkpoint_method!r} of this checkpoint is not supported; "
                         f"supported: {', '.join(CHECKPOINT_METHODS)}")
    if requested not in ("auto", "none", *QUANTIZATION_METHODS):
        raise ValueError(f"unknown quantization {requested!r}; choose auto, none, {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint_method is not None and requested not in ("auto", checkpoint_method):
        raise ValueError(f"--quantization {requested} conflicts with the checkpoint's quantization_config "
                         f"(quant_method {checkpoint_method}); use --quantization auto or {checkpoint_method}")
    if checkpoint_method is None and requested in CHECKPOINT_METHODS[:3]:
        raise ValueError(f"--quantization {requested} needs a checkpoint quantized with {requested}; this one "
                         "has no quantization_config (fp8 and int8 quantize an unquantized checkpoint at load)")
    method = checkpoint_method or (requested if requested in ("fp8", "int8") else None)
    if method == "compressed-tensors":
        from .compressed_tensors import CompressedTensorsMethod
        return CompressedTensorsMethod(quantization_config)
    if method in ("gptq", "awq"):
        from .gptq import AWQMethod, GPTQMethod
        return (GPTQMethod if method == "gptq" else AWQMethod)(quantization_config)
    if checkpoint_method == "fp8":
        from .fp8 import FP8CheckpointMethod
        return FP8CheckpointMethod(quantization_config)
    return DenseAtLoad(method) if method else None


def resolve_for_checkpoint(checkpoint: Checkpoint, requested: str) -> QuantizationMethod | None:
    """`resolve` for any model source. A GGUF file carries its own quantization: fp8 / int8
    re-quantize its dequantized weights at load, the HF checkpoint formats do not apply."""
    if checkpoint.gguf:
        if requested in ("fp8", "int8"):
            return DenseAtLoad(requested)
        if requested not in ("auto", "none"):
            raise ValueError(f"--quantization {requested} does not apply to a GGUF file (its tensor types are its "
                             "quantization); use auto, none, fp8 or int8")
        return None
    return resolve(checkpoint.quantization_config, requested)
