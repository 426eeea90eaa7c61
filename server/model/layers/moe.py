"""Top-k routed SwiGLU experts (Mixtral, Qwen3-MoE): a router, then each token through its k
experts, their outputs summed with the router's weights.

The experts' matrices are stacked, gate|up `[E, 2I, H]` and down `[E, H, I]`, and filled from
the per-expert checkpoint matrices (`experts.{e}.{gate,up,down}.weight`, names per family) so
`ops.fused_moe` runs them as a grouped GEMM: on CPU tokens sorted by expert and one matmul per
active expert, on CUDA one Triton launch per projection. Under tensor parallelism each rank
holds a slice of every expert's intermediate units (gate/up column-parallel, down row-parallel,
as vLLM does), so routing is computed whole on every rank and one all-reduce follows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from kubeinfer.kernels import ops

from ..config import MoEConfig
from .linear import Linear, ParallelRole, can_pack, linear, pack_weight

if TYPE_CHECKING:
    from ..quantization.weights import QuantizedLinearWeight

# transformers' per-expert names (gate, up, down): Qwen3-MoE's; Mixtral's are w1, w3, w2
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, expert ids) [T, k]: softmax over all experts in float32, the k largest,
    rescaled to sum to 1 with `renormalize` (as transformers' Mixtral and Qwen3-MoE routers)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedExperts(nn.Module):
    """Every expert's gate|up and down matrices in two stacked parameters (`w13`, `w2`). On CPU
    bf16, `pack()` gives each expert's matrices a oneDNN-prepacked copy (see `linear.py`:
    without it every expert matmul reorders its weight first)."""

    packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # a quantized checkpoint's experts: each one's gate|up and down compute forms, w13 / w2 None
    quant: "list[tuple[QuantizedLinearWeight, QuantizedLinearWeight]] | None" = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 names: tuple[str, str, str] = GATE_UP_DOWN) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size, self.names = \
            num_experts, hidden_size, intermediate_size, names
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def checkpoint_layout(self) -> Iterator[tuple[str, ParallelRole, int]]:
        """(checkpoint name relative to this module, parallel role, this rank's rows (columns
        for ROW)) of every per-expert matrix; tensor parallelism slices them by these roles."""
        gate, up, down = self.names
        for expert in range(self.num_experts):
            yield f"{expert}.{gate}.weight", ParallelRole.COLUMN, self.intermediate_size
            yield f"{expert}.{up}.weight", ParallelRole.COLUMN, self.intermediate_size
            yield f"{expert}.{down}.weight", ParallelRole.ROW, self.intermediate_size

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy per-expert matrix `name` (as in `checkpoint_layout`) into its rows of the stack."""
        expert, proj, _ = name.split(".")
        gate, up, _ = self.names
        size = self.intermediate_size
        target = self.w2.data[int(expert)] if proj not in (gate, up) else \
            self.w13.data[int(expert), (0 if proj == gate else size):(size if proj == gate else 2 * size)]
        if target.shape != tensor.shape:
            raise ValueError(f"expert weight {name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.copy_(tensor)

    def pack(self) -> None:
        """Prepack every expert's matrices (after loading: reloading would not update them)."""
        if self.packed is None and self.w13 is not None and can_pack(self.w13):
            self.packed = [(pack_weight(self.w13[e]), pack_weight(self.w2[e])) for e in range(self.num_experts)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:   # grouped by expert, each expert's matmuls on its compute form
            return ops.fused_moe(x, None, None, weights, ids, self._quantized_linear)
        if self.packed is not None and not ops.uses_triton(x):
            return ops.fused_moe(x, self.w13, self.w2, weights, ids, self._packed_linear)
        return ops.fused_moe(x, self.w13, self.w2, weights, ids)

    def _quantized_linear(self, rows: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        return self.quant[expert][which].forward(rows, None)

    def _packed_linear(self, rows: torch.Tensor, expert: int, which: int) -> torch.Tensor:
        return linear(rows, (self.w13, self.w2)[which][expert], self.packed[expert][which])


class SparseMoE(nn.Module):
    """Router (`gate`, replicated) + experts; checkpoint names `gate.weight`, `experts.{e}....`."""

    def __init__(self, hidden_size: int, moe: MoEConfig, names: tuple[str, str, str] = GATE_UP_DOWN) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(hidden_size, moe.num_experts, bias=False, role=ParallelRole.REPLICATED)
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)
