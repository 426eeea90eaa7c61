"""GPTQ and AWQ checkpoints, in the layouts the `gptq`/`gptqmodel` and `autoawq` packages write.

GPTQ (`quant_method: gptq`, 4 or 8 bits): `qweight` int32 [K / (32/bits), N] packed along the
input features, `qzeros` int32 [groups, N / (32/bits)] packed along the outputs, `scales`
[groups, N], `g_idx` [K] (the group of each input feature: act-order / `desc_act` shuffles it).
`checkpoint_format: gptq` (v1) stores each zero point minus one, `gptq_v2` as is; `sym` only
says the zeros are all 2^(bits-1), which the stored zeros already hold.

AWQ (`quant_method: awq`, `version: gemm`, 4 bits, zero points): `qweight` int32 [K, N / 8] and
`qzeros` int32 [groups, N / 8] packed along the outputs in AWQ's interleaved nibble order,
`scales` [groups, N].

Both become a `PackedIntWeight` (GPTQ's qweight layout is its storage already).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import QuantizationMethod, act_order_perm, expect_shape
from .weights import PackedIntWeight, pack_rows, unpack_rows

# autoawq's `order_map`: nibble i of a packed word holds column AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C / (32/bits)] packed along columns, lowest bits first (nibble i = column
    `order[i]` of its word when given) -> int32 [R, C]."""
    values = unpack_rows(packed.t().contiguous(), bits, packed.shape[1] * (32 // bits)).t()
    if order is not None:
        per_word = 32 // bits
        inverse = torch.tensor(order).argsort()
        values = values.reshape(values.shape[0], -1, per_word)[:, :, inverse].reshape(values.shape[0], -1)
    return values


def _layer_is_quantized(name: str, lm_head: bool, skipped: list[str]) -> bool:
    if any(part and part in name for part in skipped):
        return False
    return name.startswith("model.layers.") or (lm_head and name == "lm_head")


class GPTQMethod(QuantizationMethod):
    name = "gptq"

    def __init__(self, config: dict[str, Any]) -> None:
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoint: {self.bits}-bit weights are not supported (4 and 8 are)")
        self.group_size = int(config.get("group_size", 128))
        self.format = config.get("checkpoint_format") or "gptq"
        if self.format not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint: checkpoint_format {self.format!r} is not supported (gptq, gptq_v2 are)")
        if config.get("dynamic"):
            raise ValueError("GPTQ checkpoint: per-module overrides ('dynamic') are not supported")
        self.lm_head = bool(config.get("lm_head", False))
        self.skipped = list(config.get("modules_to_not_convert") or [])

    def layer_scheme(self, name: str, module: nn.Module) -> Any | None:
        return "gptq" if _layer_is_quantized(name, self.lm_head, self.skipped) else None

    def tensor_suffixes(self, scheme: Any) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def build(self, name: str, scheme: Any, tensors: dict[str, torch.Tensor]) -> PackedIntWeight:
        qweight, scales = tensors["qweight"], tensors["scales"].float()
        per_word = 32 // self.bits
        in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
        group_size = in_features if self.group_size <= 0 else self.group_size
        groups = -(-in_features // group_size)
        expect_shape(f"{name}.scales", scales, (groups, out_features))
        zeros = unpack_columns(tensors["qzeros"], self.bits)[:, :out_features].float()
        expect_shape(f"{name}.qzeros", zeros, (groups, out_features))
        if self.format == "gptq":
            zeros = zeros + 1
        perm = act_order_perm(name, tensors["g_idx"], group_size) if "g_idx" in tensors else None
        if perm is not None:
            qweight = pack_rows(unpack_rows(qweight, self.bits, in_features)[perm], self.bits)
        return PackedIntWeight(qweight.contiguous(), scales.contiguous(), zeros.contiguous(), self.bits, group_size,
                               in_features, out_features, perm)


class AWQMethod(QuantizationMethod):
    name = "awq"

    def __init__(self, config: dict[str, Any]) -> None:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint: version {version!r} is not supported (gemm is)")
        if bits != 4:
            raise ValueError(f"AWQ checkpoint: {bits}-bit weights are not supported (4 is)")
        if not config.get("zero_point", True):
            raise ValueError("AWQ checkpoint: zero_point false is not supported")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        self.skipped = list(config.get("modules_to_not_convert") or [])

    def layer_scheme(self, name: str, module: nn.Module) -> Any | None:
        return "awq" if _layer_is_quantized(name, False, self.skipped) else None

    def tensor_suffixes(self, scheme: Any) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def build(self, name: str, scheme: Any, tensors: dict[str, torch.Tensor]) -> PackedIntWeight:
        q = unpack_columns(tensors["qweight"], 4, AWQ_ORDER)
        in_features, out_features = q.shape
        group_size = in_features if self.group_size <= 0 else self.group_size
        scales = tensors["scales"].float()
        expect_shape(f"{name}.scales", scales, (-(-in_features // group_size), out_features))
        zeros = unpack_columns(tensors["qzeros"], 4, AWQ_ORDER).float()
        expect_shape(f"{name}.qzeros", zeros, tuple(scales.shape))
        return PackedIntWeight(pack_rows(q, 4), scales.contiguous(), zeros.contiguous(), 4, group_size,
                               in_features, out_features)
