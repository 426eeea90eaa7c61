"""A rank's share of a Llama-family model, and the forward that keeps the ranks in lockstep.

The model code is the TP=1 one built from `ShardPlan.local_config()`; only o_proj/down_proj,
the embedding and lm_head are swapped for their parallel forms. Rank 0's forward first sends
the batch to the workers, then every rank computes and the vocab slices of the logits are
gathered on rank 0 — so to the engine it is the plain model contract.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..model.attention import get_attention_backend
from ..model.forward_batch import ForwardBatch
from ..model.linear import Linear
from ..model.llama import LlamaForCausalLM
from ..model.loader import fill_model, uninitialized_modules
from .layers import RowParallelLinear, VocabParallelEmbedding
from .plan import ShardPlan
from .step_broadcast import send_step
from .weights import sharded_weights

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class TensorParallelLlama(LlamaForCausalLM):
    def __init__(self, plan: ShardPlan, device: torch.device) -> None:
        local = plan.local_config()
        super().__init__(local, get_attention_backend(device, local.sliding_window))
        self.plan = plan
        hidden = local.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(plan.vocab_per_rank, hidden, plan.vocab_start)
        if self.lm_head is not None:
            self.lm_head = Linear(hidden, plan.vocab_per_rank, bias=False)
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(plan.num_heads * local.head_dim, hidden, bias=False)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, hidden, bias=False)

    def forward(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor:
        """Rank 0 (the engine's side): send the step to the workers, then compute it with them."""
        send_step(batch, kv_caches[0][0].shape[0])
        logits = self.compute(batch, kv_caches)
        assert logits is not None
        return logits

    def compute(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor | None:
        """Every rank: the step over its shard; rank 0 gets the float32 logits, workers None."""
        local = super().forward(batch, kv_caches)
        vocab = self.plan.config.vocab_size
        if local.shape[0] == 0:
            return local.new_empty(0, vocab) if self.plan.rank == 0 else None
        parts = [torch.empty_like(local) for _ in range(self.plan.size)] if self.plan.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab] if parts is not None else None


def load_shard(source: Path, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> TensorParallelLlama:
    """Build this rank's model uninitialised and stream in only its slices of the weights (the
    single-process loader's steps: see `load_model`)."""
    with uninitialized_modules(device, dtype):
        model = TensorParallelLlama(plan, device).to(dtype)
    fill_model(model, sharded_weights(source, plan, dtype), device)
    return model
