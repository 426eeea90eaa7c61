"""GGUF block quantization: a GGUF file's tensor types are its quantization.

Every matrix streams in dequantized (`checkpoints/gguf_dequant.py`), so each linear layer holds
its dense weight, which prefill-sized batches run on. With `--quantization auto`, bf16 and a CPU
whose kernel reads them, the matrices stored as Q4_0, Q4_1 or Q8_0 also keep their blocks (the
checkpoint sets them aside as they stream, `Checkpoint.quantized`): once the dense weights are in
and packed, `GGUFBlocks.attach` gives each such layer a `GGUFBlockWeight`, which decode-sized
batches read. A GGUF file loaded with fp8 / int8 is re-quantized at load instead (`resolve.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kubeinfer.kernels import ops_cpu

from ..layers.linear import Linear
from .weights import GGUFBlockWeight

if TYPE_CHECKING:
    from ..checkpoints.checkpoint import Checkpoint, QuantizedBlocks
    from ..families.causal_lm import CausalLM


class GGUFBlocks:
    """GGUF's method for one load: the checkpoint's raw blocks by tensor name (filled while its
    weights stream), attached to the model's layers after loading."""

    name = "gguf"

    def __init__(self, blocks: QuantizedBlocks) -> None:
        self.blocks = blocks

    @torch.no_grad()
    def attach(self, model: CausalLM) -> int:
        """Give every Linear (and a tied lm_head) the block form of its checkpoint matrices when
        all of them are in one type the kernel packs; returns how many got one. Call after the
        model's `pack_weights`: the form keeps the layer's packed copy for larger batches."""
        count = 0
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                tiles = self._tiles([f"{source}.weight" for source, _ in model.checkpoint_sources(name, module)])
                if tiles is not None:
                    module.weight_quant = GGUFBlockWeight(tiles, module.weight, module.packed)
                    count += 1
        if model.lm_head is None:
            embedding = model.input_embeddings()
            name = next(name for name, module in model.named_modules() if module is embedding)
            tiles = self._tiles([f"{name}.weight"])
            if tiles is not None:
                model.quantized_tied_head = GGUFBlockWeight(tiles, embedding.weight, model.packed_tied_head)
                count += 1
        return count

    def _tiles(self, names: list[str]) -> ops_cpu.GGUFTiles | None:
        """The kernel form of these row blocks stacked, if all are there, of one type, and packable."""
        parts = [self.blocks.get(name) for name in names]
        if not parts or any(part is None for part in parts) or len({qtype for qtype, _ in parts}) > 1:
            return None
        qtype = parts[0][0]
        blocks = torch.cat([part[1] for part in parts]) if len(parts) > 1 else parts[0][1]
        if not ops_cpu.gguf_can_pack(qtype, blocks.shape[0], 32 * blocks.shape[1]):
            return None
        return ops_cpu.gguf_pack(qtype, blocks)


def gguf_blocks(checkpoint: Checkpoint, requested: str, device: torch.device, dtype: torch.dtype) -> GGUFBlocks | None:
    """The GGUF method when a GGUF file that set blocks aside (ask once its weights streamed)
    loads with `--quantization auto` in bf16 on a CPU whose kernel runs them; None: the dense
    weights alone. The kernel is asked last: a file without such blocks never builds it."""
    if (checkpoint.quantized and requested == "auto" and device.type == "cpu" and dtype == torch.bfloat16
            and ops_cpu.gguf_kernel_available()):
        return GGUFBlocks(checkpoint.quantized)
    return None
