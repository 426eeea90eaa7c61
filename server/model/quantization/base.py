"""What a quantization format tells the loader: which linear layers it quantized and how to turn
their checkpoint tensors into a compute form (`weights.py`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .weights import QuantizedLinearWeight

# checkpoint tensor suffixes that belong to a quantized layer (kept in the checkpoint's dtype)
QUANTIZED_TENSOR_SUFFIXES = frozenset({
    "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "input_scale",
    "qweight", "qzeros", "scales", "g_idx", "k_scale", "v_scale", "kv_scale", "output_scale"})


class QuantizationMethod:
    """One format. `layer_scheme` is called once per checkpoint linear module before the weights
    stream in; `build` gets that module's tensors (name suffix -> tensor, in the checkpoint's own
    dtypes) once they all arrived. `dense_checkpoint` formats quantize unquantized weights at load."""

    name: str = ""
    dense_checkpoint: bool = False

    def layer_scheme(self, name: str, module: nn.Module) -> Any | None:
        """The scheme of checkpoint module `name` (e.g. `model.layers.0.self_attn.q_proj`), or None
        when the format left it unquantized."""
        raise NotImplementedError

    def tensor_suffixes(self, scheme: Any) -> tuple[str, ...]:
        """The tensors (`<module>.<suffix>`) a quantized layer needs; others it may have are optional."""
        raise NotImplementedError

    def build(self, name: str, scheme: Any, tensors: dict[str, torch.Tensor]) -> QuantizedLinearWeight:
        raise NotImplementedError


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"quantized weight {name}: expected shape {shape}, got {tuple(tensor.shape)}")


def act_order_perm(name: str, g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """GPTQ act-order (`desc_act`): the input-feature order that makes groups contiguous (None when
    they already are). g_idx must put exactly `group_size` features in each group, as GPTQ does."""
    g_idx = g_idx.to(torch.int64)
    contiguous = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"quantized weight {name}: g_idx does not assign {group_size} input features to each "
                         "group; this act-order layout is not supported")
    return perm
