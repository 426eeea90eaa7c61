"""The layers tensor parallelism swaps in: a row-parallel linear, row-parallel experts and a
vocab-parallel embedding.

Column-parallel layers need no class of their own: a rank's q/k/v and gate/up are ordinary
(merged) linears over its share of the output features, built from `ShardPlan.local_config()`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..model.layers.linear import Linear, linear
from ..model.layers.moe import FusedExperts
from .group import tensor_group


class RowParallelLinear(Linear):
    """A ROW layer (o_proj, down_proj) over this rank's input features; one all-reduce sums the
    partial outputs, then the (whole, replicated) bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_quant is not None:   # this rank's input features of a quantized layer
            out = self.weight_quant.forward(x, None)
        else:
            out = linear(x, self.weight, self.packed, None)
        if self.lora is not None:   # this rank's partial delta (A sliced by input columns) joins the sum
            self.lora.apply(x, out)
        dist.all_reduce(out, group=tensor_group())
        return out if self.bias is None else out + self.bias


class RowParallelExperts(FusedExperts):
    """MoE experts over this rank's slice of every expert's intermediate units (gate/up rows,
    down columns): the routed, weighted sum of partial outputs, then one all-reduce."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(x, weights, ids)
        dist.all_reduce(out, group=tensor_group())
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the table; other ranks fill the rest.

    Each rank looks up the tokens it owns, zeroes the others, and an all-reduce assembles the
    embeddings. Its weight doubles as this rank's slice of a tied lm_head.
    """

    def __init__(self, rows_per_rank: int, hidden_size: int, vocab_start: int) -> None:
        super().__init__(rows_per_rank, hidden_size)
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        out.masked_fill_(~owned[:, None], 0)
        dist.all_reduce(out, group=tensor_group())
        return out
