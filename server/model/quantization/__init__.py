"""Quantized checkpoints, the API the loader and tensor parallelism use.

The format comes from config.json's `quantization_config` (compressed-tensors, GPTQ, AWQ, fp8),
from a GGUF file's tensor types, or from `--quantization` (fp8 / int8 quantize an unquantized
checkpoint's linear weights at load, per output channel, as vLLM's `--quantization fp8` does).
Whatever the format, a quantized linear layer computes on one compute form, `Linear.weight_quant`
(`weights.py`).

- `resolve` / `resolve_for_checkpoint` (`resolve.py`) pick a streamed method, a `QuantizationMethod`
  (`base.py`; one module per format: `compressed_tensors.py`, `gptq.py`, `fp8.py`, `at_load.py`), or
  refuse a conflict; `QuantizedLoad` (`load.py`) is the loader's hook that streams each quantized
  layer's tensors to its method and gives the layer its compute form.
- `gguf_blocks` (`gguf.py`) picks GGUF's method, `GGUFBlocks`, which keeps the layers' dense
  weights and attaches the blocks a CPU kernel reads after loading.
"""

from .base import QUANTIZED_TENSOR_SUFFIXES, QuantizationMethod
from .gguf import GGUFBlocks, gguf_blocks
from .load import QuantizedLoad, Reshard
from .resolve import CHECKPOINT_METHODS, resolve, resolve_for_checkpoint

__all__ = ["CHECKPOINT_METHODS", "GGUFBlocks", "QUANTIZED_TENSOR_SUFFIXES", "QuantizationMethod", "QuantizedLoad",
           "Reshard", "gguf_blocks", "resolve", "resolve_for_checkpoint"]
