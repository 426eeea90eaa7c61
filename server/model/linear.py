"""A linear layer holding several checkpoint matrices stacked on the output dimension.

q/k/v and gate/up run as one GEMM each (fewer, larger matmuls are faster on CPU and GPU);
the loader copies each checkpoint matrix into its row range.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint matrix number `shard` (e.g. 0 = q, 1 = k, 2 = v) into its rows of `param`."""
        start = sum(self.output_sizes[:shard])
        rows = param.data[start:start + self.output_sizes[shard]]
        if rows.shape != loaded.shape:
            raise ValueError(f"shard {shard}: expected shape {tuple(rows.shape)}, got {tuple(loaded.shape)}")
        rows.copy_(loaded)
