"""Linear layers: oneDNN-prepacked bf16 weights on CPU, and merged q/k/v and gate/up matrices.

`F.linear` on a CPU bf16 weight makes oneDNN reorder the whole weight into its blocked (AMX /
AVX512-BF16) layout on every call; at decode batch sizes that reorder costs as much as the
GEMM. `pack()` reorders once after loading; the packed GEMMs are faster (kernels/README.md)
and bit-identical to `F.linear`. A single row keeps `F.linear` on the
plain weight (torch's gemv: different rounding from oneDNN's, and the transformers reference
uses it), so the plain copy stays: packing costs one extra copy of the weights in memory.
q/k/v and gate/up run as one GEMM each (fewer, larger matmuls are faster on CPU and GPU);
the loader copies each checkpoint matrix into its row range.
A quantized layer computes on its one quantized form instead, `weight_quant` (see
`quantization/weights.py`): a quantized HF checkpoint's, which replaces the plain weight, or
GGUF's blocks, which decode-sized batches read beside the plain (and packed) weight.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from kubeinfer.kernels import ops

if TYPE_CHECKING:
    from ..adapters.lora_layers import LoRALayer
    from ..quantization.weights import QuantizedLinearWeight


class ParallelRole(enum.Enum):
    """How tensor parallelism splits a layer (Megatron-style). Layers are built at a rank's
    local size (`ShardPlan.local_config`); the role says which slice of the checkpoint a rank
    loads and whether the layer is swapped for its parallel form, so a family built from
    these layers gets tensor parallelism without code of its own."""

    REPLICATED = "replicated"  # every rank holds all of it
    COLUMN = "column"          # output features split evenly (query heads, MLP units)
    KV_COLUMN = "kv_column"    # output features split by KV head, replicated when fewer heads than ranks
    ROW = "row"                # input features split; one all-reduce sums the partial outputs
    VOCAB = "vocab"            # vocabulary rows split, padded to equal size (lm_head; embeddings too)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing helps bf16 on CPUs with native bf16; float32 stays on MKL's sgemm."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of `weight [out, in]` for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: on the `pack_weight` copy when there is one and `x` [rows, in]
    has more than one row (a single row stays on torch's gemv, see the module docstring)."""
    if packed is not None and x.shape[0] > 1:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear that runs on a prepacked weight once `pack()` was called (CPU bf16 only), and on
    its quantized form once `weight_quant` is set (see `quantization/`): a layer of a quantized
    HF checkpoint has no plain weight; a GGUF layer keeps it for the batches its blocks do not take."""

    packed: torch.Tensor | None = None
    weight_quant: "QuantizedLinearWeight | None" = None
    lora: "LoRALayer | None" = None   # adapter slots, with --enable-lora (lora_layers.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 role: ParallelRole = ParallelRole.REPLICATED) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.role = role

    def pack(self) -> None:
        """Reorder the weight for oneDNN (after loading: reloading weights would not update it)."""
        if self.packed is None and self.weight is not None and can_pack(self.weight):
            self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_quant is not None:
            out = self.weight_quant.forward(x, self.bias)
        else:
            out = linear(x, self.weight, self.packed, self.bias)
        if self.lora is not None:
            self.lora.apply(x, out)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`ops.silu_and_mul(self(x))` for a gate|up layer; in one pass with the weight's rescale
        where its kernel has that form (W8A8 at prefill sizes on the CPU), not with an adapter or a bias."""
        if self.weight_quant is not None and self.lora is None and self.bias is None:
            out = self.weight_quant.forward_silu_and_mul(x)
            if out is not None:
                return out
        return ops.silu_and_mul(self(x))


class MergedLinear(Linear):
    """Several checkpoint matrices stacked by rows (q|k|v, gate|up), each with its own role."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 roles: list[ParallelRole] | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.roles = roles or [ParallelRole.REPLICATED] * len(output_sizes)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint matrix number `shard` (e.g. 0 = q, 1 = k, 2 = v) into its rows of `param`."""
        start = sum(self.output_sizes[:shard])
        rows = param.data[start:start + self.output_sizes[shard]]
        if rows.shape != loaded.shape:
            raise ValueError(f"shard {shard}: expected shape {tuple(rows.shape)}, got {tuple(loaded.shape)}")
        rows.copy_(loaded)
