"""Which slice of a checkpoint tensor a rank holds (Megatron-style tensor parallelism), by role.

Column-parallel (output rows split): query heads and MLP units; KV-column: key/value heads;
vocab: the rows of embeddings and lm_head, padded to equal size. Row-parallel (input columns
split): the partial sums one all-reduce adds up. When there are fewer KV heads than ranks, each
KV head is replicated on N / num_kv_heads consecutive ranks (as vLLM does). Which layer has
which role is the model's business (`model.linear.ParallelRole`), not this module's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.checkpoint import Slice
from ..model.config import ModelConfig
from ..model.linear import ParallelRole

__all__ = ["ShardPlan", "Slice", "check_tensor_parallel", "kv_heads_per_rank"]


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
    if config.moe is not None and config.moe.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's expert intermediate size "
                         f"{config.moe.intermediate_size}")


def kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    """KV heads each rank caches: a share of them, or one replicated head when there are fewer than ranks."""
    return max(1, config.num_key_value_heads // size)


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
        """The config a rank builds its layers from: its share of heads and intermediate units
        (every expert's too)."""
        moe = self.config.moe
        return dataclasses.replace(self.config, num_attention_heads=self.num_heads,
                                   num_key_value_heads=self.num_kv_heads,
                                   intermediate_size=self.config.intermediate_size // self.size,
                                   moe=moe and dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size))

    def slice_for(self, role: ParallelRole, local: int, is_bias: bool = False) -> Slice | None:
        """The part of a checkpoint matrix this rank loads into a layer of `role` that has `local`
        output rows (input columns for ROW) at this rank's size; None = all of it."""
        if self.size == 1 or role is ParallelRole.REPLICATED or (role is ParallelRole.ROW and is_bias):
            return None
        if role is ParallelRole.VOCAB:
            start = min(self.vocab_start, self.config.vocab_size)
            return Slice(0, start, min(start + self.vocab_per_rank, self.config.vocab_size), self.vocab_per_rank)
        if role is ParallelRole.KV_COLUMN:
            replicas = max(1, self.size // self.config.num_key_value_heads)
            return Slice(0, self.rank // replicas * local, self.rank // replicas * local + local, local)
        return Slice(1 if role is ParallelRole.ROW else 0, self.rank * local, (self.rank + 1) * local, local)
