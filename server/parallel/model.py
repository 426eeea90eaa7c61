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

from ..model.checkpoints.checkpoint import Slice
from ..model.families.causal_lm import CausalLM
from ..model.forward_batch import ForwardBatch
from ..model.layers.attention import get_attention_backend
from ..model.layers.kv_cache_quant import KVScales, split_kv_scales
from ..model.layers.linear import Linear, MergedLinear, ParallelRole
from ..model.layers.moe import FusedExperts
from ..model.loader import fill_model, uninitialized_modules
from ..model.quantization import QuantizedLoad, Reshard
from ..model.quantization.base import QuantizationMethod
from ..model.quantization.weights import QuantizedLinearWeight
from ..model.registry import ModelFamily
from .layers import RowParallelExperts, RowParallelLinear, VocabParallelEmbedding
from .pipeline import PipelineStage, drop_other_stages
from .plan import ShardPlan
from .quantized import shard_quantized
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
            role, local = ParallelRole.VOCAB, 0
        elif isinstance(module, Linear):
            role, local = layer_role(module, shard)
        else:
            continue
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


def layer_role(module: nn.Module, shard: int | None) -> tuple[ParallelRole, int]:
    """The role of checkpoint matrix `shard` of `module` (experts: 0 gate, 1 up, 2 down) and its
    local size along the split dimension (output rows, input columns for ROW)."""
    if isinstance(module, FusedExperts):
        _, role, local = list(module.checkpoint_layout())[shard or 0]   # expert 0's gate, up, down
        return role, local
    if isinstance(module, MergedLinear) and shard is not None:
        role, rows = module.roles[shard], module.output_sizes[shard]
    else:
        role, rows = module.role, module.out_features
    return role, module.in_features if role is ParallelRole.ROW else rows


def quantized_reshard(plan: ShardPlan) -> Reshard:
    """`QuantizedLoad`'s cut of each quantized checkpoint layer to this rank's part, by its role."""

    def reshard(source: str, module: nn.Module, shard: int | None, form: QuantizedLinearWeight
                ) -> QuantizedLinearWeight:
        return shard_quantized(source, form, plan.slice_for(*layer_role(module, shard)), plan.size)

    return reshard


class TensorParallelModel(nn.Module):
    """One rank's shard of a model; to the engine (rank 0) the plain model contract."""

    def __init__(self, shard: CausalLM, plan: ShardPlan, kv_scales: dict[str, KVScales] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.shard, self.plan = shard, plan
        self.kv_scales = kv_scales or {}   # the checkpoint's fp8 KV-cache scales (per tensor: every rank's)
        self.stage = PipelineStage(shard, plan, dtype) if plan.stages > 1 else None

    def forward(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor:
        """Rank 0 (the engine's side): send the step to the workers, then compute it with them."""
        send_step(batch, kv_caches[0][0].shape[0])
        logits = self.compute(batch, kv_caches)
        assert logits is not None
        return logits

    def compute(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor | None:
        """Every rank: the step over its shard; rank 0 gets the float32 logits, workers None."""
        if self.stage is not None:
            return self.stage.compute(batch, kv_caches)
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
    if plan.stages > 1:
        drop_other_stages(model, plan)
    shard_model(model, plan)
    return model


def load_shard(source: Path, family: ModelFamily, plan: ShardPlan, dtype: torch.dtype, device: torch.device,
               method: QuantizationMethod | None = None) -> TensorParallelModel:
    """Build this rank's model uninitialised and stream in only its slices of the weights (the
    single-process loader's steps: see `load_model`). With a quantization `method`, as there the
    model is built on the meta device; its quantized layers' tensors arrive whole, become their
    compute form and are then cut to this rank's part (`quantized.py`)."""
    with uninitialized_modules(device if method is None else torch.device("meta"), dtype):
        model = build_shard(family, plan, device).to(dtype)
    hook = None
    slices = weight_slices(model, plan)
    if method is not None:
        hook = QuantizedLoad(method, model, quantized_reshard(plan))
        hook.prepare()
        model = model.to_empty(device=device)
        for layer in hook.layers:
            slices.pop(f"{layer}.weight", None)
    fused = family.resolve().fused_checkpoint_parts(plan.config)
    kv_scales: dict[str, KVScales] = {}
    slices = {plan.checkpoint_name(name): part for name, part in slices.items()}
    weights = sharded_weights(source, plan, slices, family.gguf, dtype, fused,
                              keep_quantized=method is not None and not method.dense_checkpoint)
    fill_model(model, split_kv_scales(weights, kv_scales), device, hook)
    return TensorParallelModel(model, plan, kv_scales, dtype)
