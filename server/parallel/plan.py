"""Which slice of every checkpoint tensor a rank holds (Megatron-style tensor parallelism).

Column-parallel (output rows split): q/k/v by heads, gate/up by intermediate units, and the
vocabulary of embed_tokens / lm_head. Row-parallel (input columns split): o_proj and down_proj,
whose partial sums one all-reduce adds up. When there are fewer KV heads than ranks, each KV
head is replicated on N / num_kv_heads consecutive ranks (as vLLM does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.config import ModelConfig

_HEAD_ROWS = ("self_attn.q_proj",)
_KV_ROWS = ("self_attn.k_proj", "self_attn.v_proj")
_FFN_ROWS = ("mlp.gate_proj", "mlp.up_proj")
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse sizes the model cannot be split by, naming the counts (the operator shows this message)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} neither divides nor is a multiple of the model's "
                         f"{kv_heads} key/value heads")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")


def kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    """KV heads each rank caches: a share of them, or one replicated head when there are fewer than ranks."""
    return max(1, config.num_key_value_heads // size)


@dataclass(frozen=True)
class Slice:
    dim: int        # 0 = rows (output features), 1 = columns (input features)
    start: int
    stop: int
    padded: int     # rows the rank's parameter has (vocab shards are padded to equal size)


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return kv_heads_per_rank(self.config, self.size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The config a rank builds its layers from: its share of heads and intermediate units."""
        return dataclasses.replace(self.config, num_attention_heads=self.num_heads,
                                   num_key_value_heads=self.num_kv_heads,
                                   intermediate_size=self.config.intermediate_size // self.size)

    def slice_for(self, name: str) -> Slice | None:
        """The part of checkpoint tensor `name` (transformers naming) this rank loads; None = all of it."""
        if self.size == 1:
            return None
        if name in _VOCAB_ROWS:
            start = min(self.vocab_start, self.config.vocab_size)
            return Slice(0, start, min(start + self.vocab_per_rank, self.config.vocab_size), self.vocab_per_rank)
        module = name.rpartition(".")[0].split(".", 3)[-1]   # e.g. "self_attn.q_proj"
        head_dim, is_bias = self.config.head_dim, name.endswith(".bias")
        if module in _HEAD_ROWS or module == "self_attn.o_proj":
            rows = self.num_heads * head_dim
            return self._even(0 if module in _HEAD_ROWS or is_bias else 1, self.rank * rows, rows)
        if module in _KV_ROWS:
            replicas = max(1, self.size // self.config.num_key_value_heads)
            rows = self.num_kv_heads * head_dim
            return self._even(0, self.rank // replicas * rows, rows)
        if module in _FFN_ROWS or module == "mlp.down_proj":
            units = self.config.intermediate_size // self.size
            return self._even(0 if module in _FFN_ROWS else 1, self.rank * units, units)
        return None

    @staticmethod
    def _even(dim: int, start: int, length: int) -> Slice:
        return Slice(dim, start, start + length, length)
