"""`QuantizedLoad`, the loader's hook for a streamed quantization method: before the weights
stream in it takes the plain weight off every quantized linear layer, while they stream it diverts
that layer's tensors, and at the end it gives each layer its compute form (`Linear.weight_quant`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..layers.linear import Linear
from ..layers.moe import FusedExperts
from .base import QuantizationMethod
from .weights import PackedIntWeight, QuantizedLinearWeight, ScaledWeight

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
