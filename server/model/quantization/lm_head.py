"""The output projection (lm_head, or the tied embedding matrix) read as GGUF Q8_0 blocks: int8
weights in blocks of 32 with an fp16 scale each, bf16 activations, on the CPU's GGUF kernel.

Why: a decode step reads the whole vocabulary matrix once, a large part of a small model's step
(SmolLM2-135M W8A8: 57 MB in bf16 beside 106 MB of int8 linears); Q8_0 is 8.5 bits a weight.

`--quantize-lm-head`:
- auto (default): only when the matrix's values are Q8_0 values already, bit for bit (a model
  converted from a GGUF file whose output or embedding tensor is Q8_0, as the embedded
  SmolLM2's is): the same numbers from fewer bytes. A first block of rows is checked before the
  whole matrix, so a matrix that is not (any model trained in bf16) costs a few milliseconds.
- q8_0: always; on other matrices a weight-only precision change (vLLM keeps a quantized
  checkpoint's lm_head in the model's dtype).
- none: never.

Every batch computes with the same values: decode-sized ones on the kernel's tiles, larger ones
(prompt logprobs) on the Q8_0 matrix in bf16, never on values the tiles do not hold.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType, quants

from kubeinfer.kernels import ops_cpu

from ..layers.linear import can_pack, pack_weight
from .weights import GGUFBlockWeight

if TYPE_CHECKING:
    from ..families.causal_lm import CausalLM

log = logging.getLogger(__name__)
Q8_0_BLOCK_BYTES = 34   # 32 int8 values and their fp16 scale
SAMPLE_ROWS = 64        # rows checked first in auto mode


def quantize_lm_head(model: "CausalLM", mode: str) -> bool:
    """Give the model's output projection the Q8_0 form as `mode` says (see the module
    docstring); True if it got it. ValueError naming why when q8_0 was asked and cannot run."""
    if mode == "none" or model.quantized_tied_head is not None:   # a GGUF file's own blocks
        return False
    head = model.lm_head
    weight = head.weight if head is not None else model.input_embeddings().weight
    rows, cols = weight.shape
    if mode == "auto" and not (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                               and _holds_q8_0_values(weight[:SAMPLE_ROWS])):
        return False   # before the kernel check: a model that does not qualify never waits on its build
    reason = _why_not(weight)
    if reason is not None:
        if mode == "q8_0":
            raise ValueError(f"--quantize-lm-head q8_0: {reason}")
        return False
    blocks = _q8_0_blocks(weight)
    dense = ops_cpu.gguf_dequantize("Q8_0", blocks, rows, cols)
    exact = torch.equal(dense, weight)
    if mode == "auto" and not exact:
        return False
    tiles = ops_cpu.gguf_pack("Q8_0", blocks)
    if head is not None:   # the layer keeps Q8_0's values only
        if not exact:
            head.weight.data = dense
            head.packed = None
            head.pack()
        head.weight_quant = GGUFBlockWeight(tiles, head.weight, head.packed)
    elif exact:            # the embedding's own matrix and packed copy serve larger batches
        model.quantized_tied_head = GGUFBlockWeight(tiles, weight, model.packed_tied_head)
    else:                  # the embedding keeps the checkpoint's values for the lookup
        model.packed_tied_head = None
        model.quantized_tied_head = GGUFBlockWeight(tiles, dense, pack_weight(dense) if can_pack(dense) else None)
    log.info("lm_head %d x %d read as Q8_0 blocks (%s)", rows, cols,
             "the same values" if exact else "a weight-only precision change")
    return True


def _why_not(weight: torch.Tensor) -> str | None:
    rows, cols = weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return (f"runs on the CPU in bfloat16; this model is {str(weight.dtype).removeprefix('torch.')} "
                f"on {weight.device.type}")
    if not ops_cpu.gguf_kernel_available():
        return "needs the CPU's GGUF kernel (AVX512-BF16), which this machine does not have"
    if not ops_cpu.gguf_can_pack("Q8_0", rows, cols):
        return f"an lm_head of {rows} x {cols} does not tile (vocabulary a multiple of 16, hidden size of 32)"
    return None


def _q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """gguf-py's Q8_0 quantization of `weight`, uint8 [rows, cols / 32, 34]."""
    rows, cols = weight.shape
    blocks = quants.quantize(weight.float().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(blocks).view(rows, cols // 32, Q8_0_BLOCK_BYTES)


def _holds_q8_0_values(weight: torch.Tensor) -> bool:
    """Whether gguf-py's Q8_0 round trip gives `weight` back, rounded to bf16 as a load does
    (gguf-py alone: no kernel needed to decide)."""
    if weight.shape[1] % 32:
        return False
    values = quants.dequantize(_q8_0_blocks(weight).numpy(), GGMLQuantizationType.Q8_0)
    return torch.equal(torch.from_numpy(values).reshape(weight.shape).to(weight.dtype), weight)
