"""Rotary position embeddings in the Hugging Face `rotate_half` layout, with linear, Llama-3 and
YaRN scaling (YaRN also scales cos and sin by its attention factor, as transformers does).

Angles are computed per step from the token positions (float32, as transformers does), so no
table is sized by the context length and long-context models cost nothing extra.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kubeinfer.kernels.ops import cos_sin_table

from ..forward_batch import ForwardBatch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for `rope_type` default, linear, llama3 or yarn."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "longrope":   # the short factors; `RotaryEmbedding` keeps the long ones too
        return longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    if rope_type == "dynamic":   # within the original context; `RotaryEmbedding` rescales past it
        return inv_freq
    if rope_type != "llama3":
        return inv_freq   # "default"; "freq_factors" divisors are loaded with the weights
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn more than `beta_fast` times over the original context kept,
    fewer than `beta_slow` times divided by `factor`, a linear ramp between (transformers' math)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's frequencies, each slowed by its own factor (transformers' rounding order)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (`attention_factor`, else from the scaling
    factor as transformers derives it); 1 otherwise."""
    rope_type = (scaling or {}).get("rope_type")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if rope_type == "longrope":
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """The model's rotary frequencies; which form a step uses (`cos_sin` per step or the
    position-indexed `table`) is the attention backend's choice (`AttentionBackend.rotate`).

    LongRoPE (Phi-3 128k, Phi-3.5) has two sets: a sequence rotates with the short factors while
    it is within `original_max_position_embeddings`, with the long ones in a step that takes it
    past (transformers decides per forward call the same way, so its generate agrees). Its table
    holds the short rows, then the long ones; `table_positions` points each token at its half.

    Dynamic NTK ("dynamic"): a step that takes a sequence to L > original positions rotates its
    tokens with the base theta * (factor * L / original - (factor - 1)) ^ (d / (d - 2)), per
    sequence, as transformers' generate recomputes it per forward call (the keys already cached
    keep their rotation there too). No position table can hold that: the Triton path gets the
    step's own rows (`indexed_table`)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_positions = head_dim, theta, scaling, max_positions
        self.attention_factor = rope_attention_factor(scaling)
        self.reset_inv_freq(torch.device("cpu"))

    def reset_inv_freq(self, device: torch.device) -> None:
        """(Re)compute the float32 frequencies, e.g. after the model was built on the meta device."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_inv_freq: torch.Tensor | None = None
        if (self.scaling or {}).get("rope_type") == "longrope":
            self.long_inv_freq = longrope_inv_freq(self.head_dim, self.theta, self.scaling["long_factor"]).to(device)
            self.original_max_positions = int(self.scaling["original_max_position_embeddings"])
        self.dynamic: tuple[float, int] | None = None   # (factor, original context)
        if (self.scaling or {}).get("rope_type") == "dynamic":
            self.dynamic = float(self.scaling["factor"]), int(self.scaling["original_max_position_embeddings"])
        self._table: torch.Tensor | None = None
        self._step: tuple[ForwardBatch, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._step_table: tuple[ForwardBatch, tuple[torch.Tensor, torch.Tensor]] | None = None

    def table(self) -> torch.Tensor:
        """float32 cos|sin [max_positions, head_dim] for the Triton rotary kernel, built on first use
        (after loading, so GGUF rope_freqs divisors are in)."""
        if self._table is None:
            self._table = cos_sin_table(self.inv_freq, self.max_positions, self.inv_freq.device)
            if self.long_inv_freq is not None:
                long = cos_sin_table(self.long_inv_freq, self.max_positions, self.inv_freq.device)
                self._table = torch.cat([self._table, long])
            if self.attention_factor != 1.0:
                self._table.mul_(self.attention_factor)
        return self._table

    def step_cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` of the step's positions, computed on its first layer and reused by the others
        (the engine builds a new ForwardBatch per step, never mutates one)."""
        if self._step is None or self._step[0] is not batch:
            self._step = batch, self.cos_sin(batch.positions, dtype, self._long_tokens(batch),
                                             self._dynamic_inv_freq(batch))
        return self._step[1]

    def indexed_table(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of each token, cos|sin table) for the Triton rotary kernel: the model's table, or
        with dynamic NTK the step's own rows (computed on the first layer, reused by the others)."""
        if self.dynamic is None:
            return self.table_positions(batch), self.table()
        if self._step_table is None or self._step_table[0] is not batch:
            freqs = batch.positions.float()[:, None] * self._dynamic_inv_freq(batch)
            rows = torch.arange(batch.num_tokens, device=batch.positions.device)
            self._step_table = batch, (rows, torch.cat([freqs.cos(), freqs.sin()], dim=-1))
        return self._step_table[1]

    def _dynamic_inv_freq(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Dynamic NTK: [T, head_dim / 2] frequencies of each token, from its sequence's length
        after this step (transformers' float32 arithmetic)."""
        if self.dynamic is None:
            return None
        factor, original = self.dynamic
        lengths = batch.seq_lens.to(torch.int64)
        base = self.theta * ((factor * lengths / original) - (factor - 1)) ** (self.head_dim / (self.head_dim - 2))
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=lengths.device).float() / self.head_dim
        inv_freq = torch.where((lengths > original)[:, None], 1.0 / (base[:, None] ** exponents[None, :]),
                               self.inv_freq.float()[None, :])
        query_lens = torch.tensor(batch.query_lens_cpu, device=lengths.device)
        return torch.repeat_interleave(inv_freq, query_lens, dim=0)

    def table_positions(self, batch: ForwardBatch) -> torch.Tensor:
        """The rows of `table` for the step's tokens: their positions (LongRoPE: in the long half
        for sequences past the original context)."""
        long = self._long_tokens(batch)
        return batch.positions if long is None else batch.positions + long * self.max_positions

    def _long_tokens(self, batch: ForwardBatch) -> torch.Tensor | None:
        """LongRoPE: [T] whether each token's sequence is past the original context after this step."""
        if self.long_inv_freq is None:
            return None
        query_lens = torch.tensor(batch.query_lens_cpu, device=batch.seq_lens.device)
        return torch.repeat_interleave(batch.seq_lens > self.original_max_positions, query_lens)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, long: torch.Tensor | None = None,
                token_inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] for `positions` [T], once per step for all layers
        (`long` [T]: LongRoPE tokens on the long factors; `token_inv_freq` [T, head_dim / 2]:
        each token's own frequencies, dynamic NTK).

        The sin's first half is negated, folding `rotate_half`'s negation into the table."""
        inv_freq = self.inv_freq.float()[None, :] if token_inv_freq is None else token_inv_freq
        if long is not None:
            inv_freq = torch.where(long[:, None], self.long_inv_freq.float()[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        sin[..., :freqs.shape[1]].neg_()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
