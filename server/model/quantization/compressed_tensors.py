"""compressed-tensors checkpoints (what llm-compressor writes), read with the package's own
definitions: `QuantizationConfig` for config.json, its module matching for targets/ignore, and
`unpack_from_int32` for pack-quantized weights.

Supported: pack-quantized int4/int8 weights (W4A16, W8A16; group or channel scales, symmetric or
asymmetric, act-order `weight_g_idx`), int-quantized / naive-quantized int8 weights with dynamic
per-token or static per-tensor int8 activations (W8A8) or none, and float-quantized FP8 e4m3
weights with per-tensor or per-channel scales and dynamic per-token / static activations.
Anything else (nvfp4, mxfp4, block scales, sparsity, transforms, a KV-cache scheme, output
activations) is refused at load, naming it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import QuantizationMethod, act_order_perm, expect_shape
from .weights import Fp8Weight, Int8Weight, PackedIntWeight, QuantizedLinearWeight, pack_rows

_PACKED, _INT, _FLOAT = "pack-quantized", ("int-quantized", "naive-quantized"), "float-quantized"


def _package() -> Any:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as error:
        raise ValueError("this checkpoint is quantized with compressed-tensors: install the "
                         "'compressed-tensors' package (pip install 'kubeinfer[quantization]')") from error
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match
    return QuantizationConfig, is_match, unpack_from_int32


def _check_kv_cache_scheme(scheme: Any) -> None:
    """A kv_cache_scheme's scales (`self_attn.k_scale` / `v_scale`) serve --kv-cache-dtype fp8 when
    they are fp8 per-tensor ones; other schemes are refused, naming what they are."""
    if scheme is None:
        return
    kind, bits, strategy = str(getattr(scheme.type, "value", scheme.type)), scheme.num_bits, \
        str(getattr(scheme.strategy, "value", scheme.strategy))
    if (kind, bits, strategy) != ("float", 8, "tensor") or scheme.dynamic or not scheme.symmetric:
        raise ValueError(f"compressed-tensors checkpoint: kv_cache_scheme {kind} {bits}-bit by {strategy}"
                         f"{' (dynamic)' if scheme.dynamic else ''} is not supported (fp8 per-tensor is)")


class CompressedTensorsMethod(QuantizationMethod):
    name = "compressed-tensors"

    def __init__(self, quantization_config: dict[str, Any]) -> None:
        config_class, self._is_match, self._unpack = _package()
        self.config = config_class.model_validate(quantization_config)
        _check_kv_cache_scheme(self.config.kv_cache_scheme)
        refused = {"sparsity_config": quantization_config.get("sparsity_config"),
                   "transform_config": quantization_config.get("transform_config")}
        for key, value in refused.items():
            if value:
                raise ValueError(f"compressed-tensors checkpoint: {key} is not supported")
        for group, scheme in self.config.config_groups.items():
            _check_scheme(group, scheme, scheme.format or self.config.format)

    def layer_scheme(self, name: str, module: nn.Module) -> Any | None:
        for scheme in self.config.config_groups.values():
            if self._is_match(name, module, scheme.targets, self.config.ignore or []):
                return scheme
        return None

    def _format(self, scheme: Any) -> str:
        return scheme.format or self.config.format

    def tensor_suffixes(self, scheme: Any) -> tuple[str, ...]:
        if self._format(scheme) == _PACKED:
            return ("weight_packed", "weight_scale", "weight_shape") + (
                () if scheme.weights.symmetric else ("weight_zero_point",)) + (
                ("weight_g_idx",) if scheme.weights.actorder == "group" else ())
        static = scheme.input_activations is not None and not scheme.input_activations.dynamic
        return ("weight", "weight_scale") + (("input_scale",) if static else ())

    def build(self, name: str, scheme: Any, tensors: dict[str, torch.Tensor]) -> QuantizedLinearWeight:
        args, activations = scheme.weights, scheme.input_activations
        if self._format(scheme) == _PACKED:
            return self._packed(name, args, tensors)
        weight, scale = tensors["weight"], tensors["weight_scale"].float()
        out_features = weight.shape[0]
        scale = (scale.reshape(-1).expand(out_features) if scale.numel() == 1 else scale.reshape(-1)).contiguous()
        expect_shape(f"{name}.weight_scale", scale, (out_features,))
        mode = None if activations is None else "dynamic" if activations.dynamic else "static"
        input_scale = tensors["input_scale"].float().reshape(()) if mode == "static" else None
        if self._format(scheme) == _FLOAT:
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"quantized weight {name}.weight: expected float8_e4m3fn, got {weight.dtype}")
            return Fp8Weight(weight, scale, mode, input_scale)
        if weight.dtype != torch.int8:
            raise ValueError(f"quantized weight {name}.weight: expected int8, got {weight.dtype}")
        return Int8Weight(weight, scale, mode, input_scale)

    def _packed(self, name: str, args: Any, tensors: dict[str, torch.Tensor]) -> PackedIntWeight:
        out_features, in_features = (int(size) for size in tensors["weight_shape"].tolist())
        bits = args.num_bits
        scales = tensors["weight_scale"].float()
        groups = scales.shape[1]
        group_size = args.group_size if args.strategy == "group" else in_features
        expect_shape(f"{name}.weight_scale", scales, (out_features, -(-in_features // group_size)))
        offset = 1 << (bits - 1)   # the package stores signed values; ours are unsigned
        q = self._unpack(tensors["weight_packed"], bits, torch.Size([out_features, in_features])).to(torch.int32)
        if args.symmetric:
            zeros = torch.full_like(scales, float(offset))
        else:
            zeros = self._unpack(tensors["weight_zero_point"], bits, torch.Size([out_features, groups]),
                                 packed_dim=0).float() + offset
        q = (q + offset).t()
        perm = None
        if "weight_g_idx" in tensors:
            perm = act_order_perm(name, tensors["weight_g_idx"], group_size)
            if perm is not None:
                q = q[perm]
        return PackedIntWeight(pack_rows(q, bits), scales.t().contiguous(), zeros.t().contiguous(), bits,
                               group_size, in_features, out_features, perm)


def _check_scheme(group: str, scheme: Any, format: str) -> None:
    """Refuse, naming it, what the compute forms cannot run."""
    weights, activations = scheme.weights, scheme.input_activations

    def refuse(what: str) -> None:
        raise ValueError(f"compressed-tensors config group {group!r} (format {format}): {what} is not supported")

    if scheme.output_activations is not None:
        refuse("output activation quantization")
    if weights is None:
        refuse("activation-only quantization")
    strategy = weights.strategy
    if format == _PACKED:
        if weights.type != "int" or weights.num_bits not in (4, 8):
            refuse(f"{weights.num_bits}-bit {weights.type} packed weights")
        if strategy not in ("group", "channel"):
            refuse(f"{strategy} weight scales")
        if activations is not None:
            refuse("activation quantization with packed weights")
    elif format in _INT or format == _FLOAT:
        wanted = "float" if format == _FLOAT else "int"
        if weights.type != wanted or weights.num_bits != 8:
            refuse(f"{weights.num_bits}-bit {weights.type} weights")
        if strategy not in ("channel", "tensor"):
            refuse(f"{strategy} weight scales")
        if not weights.symmetric:
            refuse("asymmetric weights")
        if activations is not None:
            if activations.type != wanted or activations.num_bits != 8 or not activations.symmetric:
                refuse(f"{'symmetric' if activations.symmetric else 'asymmetric'} {activations.num_bits}-bit "
                       f"{activations.type} activations")
            if activations.dynamic and activations.strategy != "token":
                refuse(f"dynamic {activations.strategy} activation scales")
            if not activations.dynamic and activations.strategy != "tensor":
                refuse(f"static {activations.strategy} activation scales")
    else:
        refuse("this format")
