"""Rotary cos/sin cache construction, including Llama-3 and linear frequency scaling.

Layout (shared by the Triton kernel and the torch reference): `[max_positions, rotary_dim]`
float32, the first half cos(pos * inv_freq), the second half sin(pos * inv_freq) — the
Hugging Face `rotate_half` convention, where dimension i pairs with i + rotary_dim / 2.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(rotary_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """`[rotary_dim / 2]` float32 inverse frequencies after the model's rope_scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    smooth = (old_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelength >= old_context / high_freq_factor) & (wavelength <= old_context / low_freq_factor)
    return torch.where(is_medium, blended, scaled)


def build_rope_cache(rotary_dim: int, max_positions: int, theta: float,
                     rope_scaling: dict[str, Any] | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """The `[max_positions, rotary_dim]` float32 cos|sin table the rotary ops index by position."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    return cos_sin_table(inverse_frequencies(rotary_dim, theta, rope_scaling), max_positions, device)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The cos|sin table from ready inverse frequencies (e.g. a model's, after GGUF rope_freqs)."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq.to(device=device, dtype=torch.float32))
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
