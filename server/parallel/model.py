"""A rank's share of any registered model family, and the forward that keeps the ranks in lockstep.

The family's model is built from `ShardPlan.local_config()` (its share of heads and MLP
units), then layers are swapped by role: row-parallel linears and vocab-parallel embeddings /
lm_heads for their parallel forms (`layers.py`). Which slice of each checkpoint tensor a rank
loads follows from the same roles (`weight_slices`). Rank 0's forward first sends the batch to
the workers, then every rank computes and the vocab slices of the logits are gathered on rank
0 — so to the engine it is the plain model contract. No family is named here.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..model.attention import get_attention_backend
from ..model.causal_lm import CausalLM
from ..model.checkpoint import Slice
from ..model.forward_batch import ForwardBatch
from ..model.kv_cache_quant import KVScales, split_kv_scales
from ..model.linear import Linear, MergedLinear, ParallelRole
from ..model.loader import fill_model, uninitialized_modules
from ..model.moe import FusedExperts
from ..model.registry import ModelFamily
from .layers import RowParallelExperts, RowParallelLinear, VocabParallelEmbedding
from .plan import ShardPlan
from .step_broadcast import send_step
from .weights import sharded_weights

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]   # or LayerKVCache (an fp8 cache with its scales)


def shard_model(model: CausalLM, plan: ShardPlan) -> None:
    """Swap the layers whose role needs a parallel form, in place (before weights are loaded)."""
    for name, module in list(model.named_modules()):
        replacement: nn.Module | None = None
        if isinstance(module, nn.Embedding):
            replacement = VocabParallelEmbedding(plan.vocab_per_rank, module.embedding_dim, plan.vocab_start)
        elif isinstance(module, Linear) and module.role is ParallelRole.ROW:
            replacement = RowParallelLinear(module.in_features, module.out_features, bias=module.bias is not None,
                                            role=ParallelRole.ROW)
        elif isinstance(module, Linear) and module.role is ParallelRole.VOCAB:
            replacement = Linear(module.in_features, plan.vocab_per_rank, bias=module.bias is not None,
                                 role=ParallelRole.VOCAB)
        elif isinstance(module, FusedExperts) and plan.size > 1:
            replacement = RowParallelExperts(module.num_experts, module.w2.shape[1], module.intermediate_size,
                                             module.names)
        if replacement is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, replacement)


def weight_slices(model: CausalLM, plan: ShardPlan) -> dict[str, Slice]:
    """Checkpoint tensor name -> the slice this rank loads, from the roles of the layers of a
    model built for `plan`; tensors not named are loaded whole."""
    slices: dict[str, Slice] = {}
    for source, module, shard in model.checkpoint_modules():
        if isinstance(module, nn.Embedding):
            role, rows = ParallelRole.VOCAB, 0
        elif isinstance(module, MergedLinear) and shard is not None:
            role, rows = module.roles[shard], module.output_sizes[shard]
        elif isinstance(module, Linear):
            role, rows = module.role, module.out_features
        else:
            continue
        local = module.in_features if role is ParallelRole.ROW else rows
        for kind in ("weight", "bias"):
            part = plan.slice_for(role, local, is_bias=kind == "bias")
            if part is not None:
                slices[f"{source}.{kind}"] = part
    for name, (module, part_name) in model.stacked_tensors().items():   # per-expert matrices, by their roles
        role, local = next((role, local) for part, role, local in module.checkpoint_layout() if part == part_name)
        part = plan.slice_for(role, local)
        if part is not None:
            slices[name] = part
    return slices


class TensorParallelModel(nn.Module):
    """One rank's shard of a model; to the engine (rank 0) the plain model contract."""

    def __init__(self, shard: CausalLM, plan: ShardPlan, kv_scales: dict[str, KVScales] | None = None) -> None:
        super().__init__()
        self.shard, self.plan = shard, plan
        self.kv_scales = kv_scales or {}   # the checkpoint's fp8 KV-cache scales (per tensor: every rank's)

    def forward(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor:
        """Rank 0 (the engine's side): send the step to the workers, then compute it with them."""
        send_step(batch, kv_caches[0][0].shape[0])
        logits = self.compute(batch, kv_caches)
        assert logits is not None
        return logits

    def compute(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor | None:
        """Every rank: the step over its shard; rank 0 gets the float32 logits, workers None."""
        local = self.shard(batch, kv_caches)
        vocab = self.plan.config.vocab_size
        if local.shape[0] == 0:
            return local.new_empty(0, vocab) if self.plan.rank == 0 else None
        parts = [torch.empty_like(local) for _ in range(self.plan.size)] if self.plan.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab] if parts is not None else None


def build_shard(family: ModelFamily, plan: ShardPlan, device: torch.device) -> CausalLM:
    """This rank's model with parallel layers swapped in; call under `uninitialized_modules`."""
    local = plan.local_config()
    model = family.build(local, get_attention_backend(device, local.sliding_window))
    shard_model(model, plan)
    return model


def load_shard(source: Path, family: ModelFamily, plan: ShardPlan, dtype: torch.dtype,
               device: torch.device) -> TensorParallelModel:
    """Build this rank's model uninitialised and stream in only its slices of the weights (the
    single-process loader's steps: see `load_model`)."""
    with uninitialized_modules(device, dtype):
        model = build_shard(family, plan, device).to(dtype)
    fused = family.resolve().fused_checkpoint_parts(plan.config)
    kv_scales: dict[str, KVScales] = {}
    weights = sharded_weights(source, plan, weight_slices(model, plan), family.gguf, dtype, fused)
    fill_model(model, split_kv_scales(weights, kv_scales), device)
    return TensorParallelModel(model, plan, kv_scales)
