"""Top-k routed SwiGLU experts in Triton: a grouped GEMM over tokens sorted by expert (vLLM's fused_moe).

The host sorts the T x k (token, expert) pairs by expert and pads each expert's run to a
multiple of BLOCK_M (`align_by_expert`, torch ops only, no device sync). A program owns
BLOCK_M rows of one expert and BLOCK_N output columns; rows past an expert's run, and blocks
past the last expert, are skipped. Two launches: gate|up over the gathered token rows, then,
after SiLU-and-mul, down with the router weight applied in float32; the k rows of a token are
summed last. Accumulation is float32 (`tl.dot`); the same contract as `moe_ref.fused_moe_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import silu_and_mul
from .tuning import MOE_CONFIGS


@triton.autotune(configs=MOE_CONFIGS, key=["N", "K"])
@triton.jit
def _grouped_gemm_kernel(c_ptr, a_ptr, b_ptr, weights_ptr, slots_ptr, block_experts_ptr,
                         num_slots, N, K, num_experts, stride_am, stride_be, stride_bn, stride_cm,
                         ROWS_PER_A: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[slot] = a[slot // ROWS_PER_A] @ b[expert].T (x weights[slot]) for the slots of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < num_experts:
        slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = slots < num_slots
        a_rows = tl.where(valid, slots // ROWS_PER_A, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)
            b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        if MUL_WEIGHTS:
            acc = acc * tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]
        tl.store(c_ptr + slots[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_mask[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, block_experts): the flat (token, choice) slots `t * k + j` sorted by expert, each
    expert's run padded to a multiple of `block_m` with the sentinel T * k; and the expert of each
    block of `block_m` slots (`num_experts` for blocks past the end). Sized for the worst case
    (every expert padded), so the launch grid needs no device sync."""
    flat = ids.reshape(-1).to(torch.int64)
    count = flat.numel()
    per_expert = torch.bincount(flat, minlength=num_experts)
    padded = (per_expert + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(count, device=ids.device) - (torch.cumsum(per_expert, 0) - per_expert)[sorted_experts]
    capacity = triton.cdiv(count + num_experts * (block_m - 1), block_m) * block_m
    slots = torch.full((capacity,), count, dtype=torch.int32, device=ids.device)
    slots[(padded_end - padded)[sorted_experts] + rank] = order.to(torch.int32)
    blocks = torch.arange(capacity // block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end // block_m, blocks, right=True).to(torch.int32)
    return slots, block_experts


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                  block_experts: torch.Tensor, block_m: int, rows_per_a: int, mul_weights: bool) -> None:
    num_experts, n, k = b.shape
    grid = lambda meta: (block_experts.shape[0], triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _grouped_gemm_kernel[grid](out, a, b, weights, slots, block_experts, out.shape[0], n, k, num_experts,
                               a.stride(0), b.stride(0), b.stride(1), out.stride(0),
                               ROWS_PER_A=rows_per_a, MUL_WEIGHTS=mul_weights, BLOCK_M=block_m)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """Same contract as `moe_ref.fused_moe_ref` (x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    weights [T, k] float32, ids [T, k])."""
    num_tokens, top_k = ids.shape
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    # 16 rows: decode-sized batches waste little on padding; 64 once experts see many tokens each
    block_m = 16 if num_tokens * top_k <= 16 * w13.shape[0] else 64
    slots, block_experts = align_by_expert(ids, w13.shape[0], block_m)
    weights = weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, slots, block_experts, block_m, top_k, False)
    down = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(silu_and_mul(gate_up), w2, down, weights, slots, block_experts, block_m, 1, True)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
