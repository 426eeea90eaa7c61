"""LoRA adapters in PEFT's format: read, check against the base model, and shape for the layers.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`)
with `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] per
target module. Reading gives per checkpoint module (transformers' names, e.g.
`model.layers.3.self_attn.q_proj`) its A and its B already multiplied by the scale
(lora_alpha / r, or / sqrt(r) with use_rslora), so the forward is x @ A.T @ B.T.
Anything the engine would silently compute wrong is refused with a `LoRAError` naming it:
DoRA, trained biases, modules_to_save, a target the model lacks, a rank above the maximum,
shapes of another base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# the projections LoRA may patch: every Linear of the decoder layers
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter the engine cannot serve; the message names the adapter and what is wrong."""


class LoRAPathError(LoRAError):
    """Nothing readable as an adapter at the path: its message says what the filesystem holds
    there, which the runtime API must not tell its caller (`server/api/lora.py`)."""


@dataclass
class LoRAWeights:
    """One adapter in host memory: per checkpoint module, A [r, in] and scaled B [out, r]."""

    name: str
    path: str
    rank: int                                          # the largest rank of its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def _read_config(path: Path, name: str) -> dict:
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise LoRAPathError(f"LoRA adapter {name!r}: {path} is not a directory")
    if not config_file.is_file():
        raise LoRAPathError(f"LoRA adapter {name!r}: {path} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LoRAPathError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON: {error}") from error
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained layers)")):
        if config.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r} (trained biases) is not supported; "
                        "only bias='none'")
    return config


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    safetensors, binary = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if safetensors.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors))
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise LoRAPathError(f"LoRA adapter {name!r}: {path} has neither adapter_model.safetensors nor adapter_model.bin")


def _alpha(config: dict, module: str, rank: int) -> float:
    """lora_alpha, or the alpha_pattern entry whose key ends this module's name (PEFT's match)."""
    for key, alpha in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return float(alpha)
    return float(config.get("lora_alpha", rank))


def read_peft_adapter(name: str, path: str | Path, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """Read an adapter directory into host memory (in `dtype`), scale folded into B."""
    path = Path(path)
    config = _read_config(path, name)
    tensors = _read_tensors(path, name)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A/lora_B weights are "
                            "supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise LoRAPathError(f"LoRA adapter {name!r}: no lora_A/lora_B weights in {path}")
    weights = LoRAWeights(name, str(path), 0)
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}, not [r, in] and [out, r]")
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: rank {rank} of {module} is above --max-lora-rank {max_rank}")
        alpha = _alpha(config, module, rank)
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights.modules[module] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
        weights.rank = max(weights.rank, rank)
    return weights
