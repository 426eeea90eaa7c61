"""Which slice of a checkpoint tensor a rank holds (Megatron-style tensor parallelism), by role.

Column-parallel (output rows split): query heads and MLP units; KV-column: key/value heads;
vocab: the rows of embeddings and lm_head, padded to equal size. Row-parallel (input columns
split): the partial sums one all-reduce adds up. When there are fewer KV heads than ranks, each
KV head is replicated on N / num_kv_heads consecutive ranks (as vLLM does). Which layer has
which role is the model's business (`model.linear.ParallelRole`), not this module's.

Pipeline parallelism cuts the decoder layers into `stages` consecutive runs (earlier stages take
the remainder); a stage builds only its layers, numbered from 0, and reads the checkpoint's
`model.layers.N` under its local numbers (`local_name`). The embeddings live on the first stage
(and on the last when the head is tied to them), the final norm and head on the last.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..model.checkpoints.checkpoint import Slice
from ..model.config import ModelConfig
from ..model.layers.linear import ParallelRole

__all__ = ["ShardPlan", "Slice", "check_pipeline_parallel", "check_tensor_parallel", "kv_heads_per_rank",
           "stage_layers"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


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


def check_pipeline_parallel(config: ModelConfig, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {stages}")
    if stages > config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {config.num_hidden_layers} layers")
    if stages > 1 and config.layer_types:
        raise ValueError(f"{config.architecture}: pipeline parallelism of models that mix sliding-window and "
                         "full-attention layers is not supported yet")


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The decoder layers of pipeline stage `stage`: an even split, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    """KV heads each rank caches: a share of them, or one replicated head when there are fewer than ranks."""
    return max(1, config.num_key_value_heads // size)


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig
    rank: int              # within the stage's tensor-parallel group
    size: int              # tensor-parallel ranks per stage
    stage: int = 0
    stages: int = 1

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)
        check_pipeline_parallel(self.config, self.stages)

    @property
    def global_rank(self) -> int:
        """Rank in the whole group: stages of `size` consecutive ranks (tensor parallelism innermost)."""
        return self.stage * self.size + self.rank

    @property
    def layers(self) -> range:
        return stage_layers(self.config.num_hidden_layers, self.stage, self.stages)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def holds_embeddings(self) -> bool:
        return self.first_stage or (self.last_stage and self.config.tie_word_embeddings)

    def local_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this stage's model, or None when the stage does not hold it."""
        if self.stages == 1:
            return name
        match = _LAYER.match(name)
        if match:
            layer = int(match[1])
            if layer not in self.layers:
                return None
            return f"model.layers.{layer - self.layers.start}.{name[match.end():]}"
        if name.startswith("model.embed_tokens."):
            return name if self.holds_embeddings else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.last_stage else None
        return name

    def checkpoint_name(self, name: str) -> str:
        """The inverse of `local_name` for a tensor this stage holds."""
        match = _LAYER.match(name)
        if self.stages == 1 or not match:
            return name
        return f"model.layers.{int(match[1]) + self.layers.start}.{name[match.end():]}"

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
        moe, layers = self.config.moe, self.layers
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size,
                                      dense_layers=frozenset(i - layers.start for i in moe.dense_layers if i in layers))
        return dataclasses.replace(self.config, num_attention_heads=self.num_heads,
                                   num_key_value_heads=self.num_kv_heads,
                                   intermediate_size=self.config.intermediate_size // self.size,
                                   num_hidden_layers=len(layers), moe=moe)

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
