"""Top-k routed SwiGLU experts in torch, grouped by expert: the CPU path and the reference for `moe.py`.

The T x k (token, expert) pairs are sorted by expert, so each active expert runs one gate|up and
one down matmul over all of its tokens (no per-token loop; experts no token chose cost nothing).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from .activation_ref import silu_and_mul_ref


# (rows [n, in], expert, 0 = gate|up or 1 = down) -> rows @ that matrix.T
ExpertLinear = Callable[[torch.Tensor, int, int], torch.Tensor]


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None, weights: torch.Tensor,
                  ids: torch.Tensor, expert_linear: ExpertLinear | None = None) -> torch.Tensor:
    """`sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` over `e = ids[t, j]`.

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights [T, k] float32;
    ids [T, k] int. Each expert's output is scaled in float32 and rounded to x's dtype, then
    the k outputs of a token are summed (transformers' Mixtral rounds the same way).
    `expert_linear` replaces `F.linear` on w13[e] / w2[e] (e.g. with prepacked CPU weights, or
    quantized experts, which pass no w13 / w2)."""
    if expert_linear is None:
        expert_linear = lambda rows, e, which: F.linear(rows, (w13, w2)[which][e])  # noqa: E731
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    counts = torch.bincount(flat).tolist()
    grouped = x.index_select(0, tokens)
    out = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            out[rows] = expert_linear(silu_and_mul_ref(expert_linear(grouped[rows], expert, 0)), expert, 1)
            start += count
    scaled = (out.float() * weights.reshape(-1)[order, None].float()).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)
