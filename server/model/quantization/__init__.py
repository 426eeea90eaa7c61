"""Quantized HF checkpoints: the format comes from config.json's `quantization_config`
(compressed-tensors, GPTQ, AWQ) or from `--quantization` (fp8 / int8 quantize an unquantized
checkpoint's linear weights at load, per output channel, as vLLM's `--quantization fp8` does).

`resolve` picks the method (or refuses a conflict); `QuantizedLoad` is the loader's one hook:
before the weights stream in it takes the plain weight off every quantized linear layer, while
they stream it diverts that layer's tensors, and at the end it gives each layer its compute form
(`Linear.weight_quant`, see `weights.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ...flags import QUANTIZATION_METHODS
from ..layers.linear import Linear
from ..layers.moe import FusedExperts
from .base import QuantizationMethod
from .weights import QuantizedLinearWeight, quantize_per_channel

if TYPE_CHECKING:
    from ..checkpoints.checkpoint import Checkpoint

# config.json `quant_method`s read (fp8: AutoFP8 / vLLM's FP8 export)
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
# checkpoint tensor suffixes that belong to a quantized layer (kept in the checkpoint's dtype)
QUANTIZED_TENSOR_SUFFIXES = frozenset({
    "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "input_scale",
    "qweight", "qzeros", "scales", "g_idx", "k_scale", "v_scale", "kv_scale", "output_scale"})


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


# (checkpoint module name, the Linear or FusedExperts holding it, shard index, whole compute form) -> the
# part to keep
Reshard = Callable[[str, nn.Module, "int | None", QuantizedLinearWeight], QuantizedLinearWeight]


class QuantizedLoad:
    """The loader hook for one model: `prepare` before the weights stream, `divert` around the
    stream, `finish` after it. `reshard` cuts each checkpoint layer's compute form down to the
    part a tensor-parallel rank holds (`parallel/quantized.py`)."""

    def __init__(self, method: QuantizationMethod, model: nn.Module, reshard: Reshard | None = None) -> None:
        self.method, self.reshard = method, reshard
        # checkpoint module name -> (module holding it, shard index or None, scheme, expert index or None):
        # a Linear (shard: its part of a merged matrix) or FusedExperts (shard: 0 gate, 1 up, 2 down)
        self.layers: dict[str, tuple[nn.Module, int | None, Any, int | None]] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        by_module: dict[tuple[int, int | None], list[tuple[str, Any]]] = {}
        for source, module, shard in model.checkpoint_modules():
            if isinstance(module, FusedExperts):
                for name, expert, which in _expert_matrices(source, module):
                    scheme = method.layer_scheme(name, _EXPERT_LINEAR)
                    by_module.setdefault((id(module), None), []).append((name, scheme))
                    if scheme is not None:
                        self.layers[name] = (module, which, scheme, expert)
                continue
            if not isinstance(module, Linear):
                continue
            scheme = method.layer_scheme(source, module)
            by_module.setdefault((id(module), None), []).append((source, scheme))
            if scheme is not None:
                self.layers[source] = (module, shard, scheme, None)
        for parts in by_module.values():
            if len({scheme is None for _, scheme in parts}) > 1:
                names = ", ".join(source for source, _ in parts[:6]) + (", ..." if len(parts) > 6 else "")
                raise ValueError(f"{method.name}: {names} are computed as one matrix, so they must be quantized "
                                 "alike; this checkpoint quantizes only some of them")
        self.modules = {id(module): module for module, _, _, _ in self.layers.values()}

    def prepare(self) -> int:
        """Drop the plain weights of every quantized layer (the checkpoint has none to fill them)."""
        for module in self.modules.values():
            if isinstance(module, FusedExperts):
                module.w13 = module.w2 = None
                module.quant = [None] * module.num_experts
            else:
                module.weight = None
        return len(self.modules)

    def divert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without the quantized layers' tensors, which are kept for `finish`."""
        for name, tensor in weights:
            module_name, _, suffix = name.rpartition(".")
            if module_name in self.layers and suffix != "bias":
                self.tensors.setdefault(module_name, {})[suffix] = tensor
            else:
                yield name, tensor

    def finish(self, device: torch.device) -> None:
        """Each quantized layer's compute form, from its (merged) checkpoint modules' tensors."""
        parts: dict[tuple[int, int | None], list[tuple[int | None, QuantizedLinearWeight]]] = {}
        for source, (module, shard, scheme, expert) in self.layers.items():
            tensors = {suffix: tensor.to(device) for suffix, tensor in self.tensors.pop(source, {}).items()}
            missing = [suffix for suffix in self.method.tensor_suffixes(scheme) if suffix not in tensors]
            if missing:
                raise ValueError(f"{self.method.name} checkpoint is missing {', '.join(f'{source}.{s}' for s in missing)}")
            form = self.method.build(source, scheme, tensors)
            if self.reshard is not None:
                form = self.reshard(source, module, shard, form)
            parts.setdefault((id(module), expert), []).append((shard, form))
        for (key, expert), built in parts.items():
            module = self.modules[key]
            forms = [form for _, form in sorted(built, key=lambda part: part[0] or 0)]
            if expert is None:
                module.weight_quant = _checked(self.method.name, _merge(forms), module.out_features,
                                               module.in_features)
                continue
            hidden, units = module.hidden_size, module.intermediate_size
            module.quant[expert] = (_checked(self.method.name, _merge(forms[:2]), 2 * units, hidden),
                                    _checked(self.method.name, forms[2], hidden, units))


# what a per-expert matrix is to a format's module matching (compressed-tensors targets "Linear")
_EXPERT_LINEAR = nn.Linear(1, 1, device="meta")


def _expert_matrices(source: str, module: FusedExperts) -> Iterator[tuple[str, int, int]]:
    """(checkpoint module name, expert, 0 gate / 1 up / 2 down) of every per-expert matrix."""
    for expert in range(module.num_experts):
        for which, proj in enumerate(module.names):
            yield f"{source}.{expert}.{proj}", expert, which


def _checked(method: str, weight: QuantizedLinearWeight, out_features: int, in_features: int) -> QuantizedLinearWeight:
    if (weight.out_features, weight.in_features) != (out_features, in_features):
        raise ValueError(f"{method}: quantized weight of shape [{weight.out_features}, {weight.in_features}] for a "
                         f"layer of [{out_features}, {in_features}]")
    return weight


def _merge(forms: list[QuantizedLinearWeight]) -> QuantizedLinearWeight:
    """Row blocks of one merged linear (q|k|v, gate|up) as one compute form: stacked along the
    output features, which every form keeps as its own dimension."""
    from dataclasses import replace

    from .weights import PackedIntWeight, ScaledWeight
    first = forms[0]
    if len(forms) == 1:
        return first
    if any(type(form) is not type(first) for form in forms):
        raise ValueError("the parts of a merged linear layer are quantized in different forms")
    if isinstance(first, PackedIntWeight):
        same = all((f.bits, f.group_size, f.in_features) == (first.bits, first.group_size, first.in_features)
                   for f in forms)
        perms = [f.perm for f in forms]
        if not same or any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0]))
                           for p in perms):
            raise ValueError("the parts of a merged linear layer differ in bits, group size or act-order")
        return replace(first, qweight=torch.cat([f.qweight for f in forms], 1),
                       scales=torch.cat([f.scales for f in forms], 1), zeros=torch.cat([f.zeros for f in forms], 1),
                       out_features=sum(f.out_features for f in forms))
    assert isinstance(first, ScaledWeight)
    if any(f.activations != first.activations for f in forms):
        raise ValueError("the parts of a merged linear layer quantize activations differently")
    input_scale = None
    if first.activations == "static":   # one scale for the merged input: the largest, as vLLM
        input_scale = torch.stack([f.input_scale for f in forms]).max()
    return replace(first, weight=torch.cat([f.weight for f in forms]), scale=torch.cat([f.scale for f in forms]),
                   input_scale=input_scale)
