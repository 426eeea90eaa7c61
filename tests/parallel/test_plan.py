"""Which slice of each checkpoint tensor a rank loads, and the sizes refused at start."""

from __future__ import annotations

import pytest
import torch

from kubeinfer.server.model.config import ModelConfig
from kubeinfer.server.model.layers.linear import ParallelRole
from kubeinfer.server.model.loader import uninitialized_modules
from kubeinfer.server.model.registry import model_family
from kubeinfer.server.parallel.model import build_shard, weight_slices
from kubeinfer.server.parallel.plan import ShardPlan, Slice, check_tensor_parallel

pytestmark = pytest.mark.unit


def config(heads: int = 8, kv_heads: int = 2, vocab: int = 100, intermediate: int = 64) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=heads * 4, intermediate_size=intermediate,
                       num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=4,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64)


def slices(plan: ShardPlan) -> dict[str, Slice]:
    """Checkpoint name -> slice, from the roles of the layers of the rank's model."""
    with uninitialized_modules(torch.device("cpu"), torch.float32):
        model = build_shard(model_family(plan.config.architecture), plan, torch.device("cpu"))
    return weight_slices(model, plan)


@pytest.mark.parametrize("model, size, message", [
    (config(heads=9, kv_heads=3), 2, "tensor_parallel_size 2 does not divide the model's 9 attention heads"),
    (config(heads=12, kv_heads=3), 2, "tensor_parallel_size 2 neither divides nor is a multiple of the model's "
                                      "3 key/value heads"),
    (config(intermediate=66), 4, "tensor_parallel_size 4 does not divide the model's intermediate size 66"),
])
def test_sizes_the_model_cannot_split_are_refused_naming_the_counts(model, size, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(model, size)


def test_attention_and_mlp_shards_cover_the_model_once():
    model = config(heads=8, kv_heads=4)
    plans = [slices(ShardPlan(model, rank, 2)) for rank in range(2)]
    q = [plan.get("model.layers.0.self_attn.q_proj.weight") for plan in plans]
    assert q == [Slice(0, 0, 16, 16), Slice(0, 16, 32, 16)]
    assert plans[1].get("model.layers.0.self_attn.o_proj.weight") == Slice(1, 16, 32, 16)
    assert plans[1].get("model.layers.0.self_attn.k_proj.weight") == Slice(0, 8, 16, 8)
    assert plans[1].get("model.layers.0.mlp.down_proj.weight") == Slice(1, 32, 64, 32)
    assert plans[0].get("model.layers.0.mlp.up_proj.weight") == Slice(0, 0, 32, 32)
    assert plans[0].get("model.layers.0.input_layernorm.weight") is None


def test_a_bias_follows_its_rows_and_a_row_parallel_bias_stays_whole():
    model = config(heads=8, kv_heads=4)
    assert ShardPlan(model, 1, 2).slice_for(ParallelRole.KV_COLUMN, 8, is_bias=True) == Slice(0, 8, 16, 8)
    assert ShardPlan(model, 1, 2).slice_for(ParallelRole.ROW, 16, is_bias=True) is None


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head():
    plans = [ShardPlan(config(heads=8, kv_heads=2), rank, 4) for rank in range(4)]
    assert [plan.num_kv_heads for plan in plans] == [1] * 4
    kv = [slices(plan)["model.layers.0.self_attn.v_proj.weight"] for plan in plans]
    assert [(s.start, s.stop) for s in kv] == [(0, 4), (0, 4), (4, 8), (4, 8)]


def test_vocab_shards_are_padded_to_equal_size():
    plans = [ShardPlan(config(vocab=100, heads=3, kv_heads=3, intermediate=63), rank, 3) for rank in range(3)]
    rows = [slices(plan)["lm_head.weight"] for plan in plans]
    assert rows == [Slice(0, 0, 34, 34), Slice(0, 34, 68, 34), Slice(0, 68, 100, 34)]
    assert plans[2].vocab_start == 68
