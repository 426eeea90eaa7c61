"""Packed-integer weight GEMM in Triton (W4A16 / W8A16): x [M, K] in fp16/bf16/fp32 times 4- or
8-bit weights dequantized inside the GEMM, never written out.

A program owns a BLOCK_M x BLOCK_N tile of the output. Each K step loads BLOCK_K x BLOCK_N
packed words (32/bits values each along K, GPTQ's layout, see `w4a16_ref.py`), shifts out its
values, subtracts the zero points and multiplies by the scales of each element's group in
float32, casts to x's dtype and feeds `tl.dot` with a float32 accumulator. When a K step
lies inside one group, one row of scales and zeros serves it; otherwise they are looked up per
K element, so any group size works (a group per channel included) and K need not be a
multiple of the block. Decode reads 4x (8-bit: 2x) fewer weight bytes than bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import W4A16_CONFIGS


@triton.autotune(configs=W4A16_CONFIGS, key=["N", "K"])
@triton.jit
def _packed_gemm_kernel(c_ptr, a_ptr, qweight_ptr, scales_ptr, zeros_ptr, M, N, K, stride_am, stride_cm,
                        BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, IEEE_FP32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c = a @ dequant(qweight) for one output tile."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # a K step inside one group (group 128 or channel scales, the usual checkpoints): one row of
    # scales and zeros per step instead of one per element
    SCALE_ROW: tl.constexpr = GROUP_SIZE % BLOCK_K == 0
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        tile_mask = k_mask[:, None] & col_mask[None, :]
        packed = tl.load(qweight_ptr + (ks[:, None] // PER_WORD).to(tl.int64) * N + cols[None, :],
                         mask=tile_mask, other=0)
        q = (packed >> ((ks[:, None] % PER_WORD) * BITS)) & MASK
        if SCALE_ROW:
            group_row = (start // GROUP_SIZE) * N + cols
            scales = tl.load(scales_ptr + group_row, mask=col_mask, other=0.0)[None, :]
            zeros = tl.load(zeros_ptr + group_row, mask=col_mask, other=0.0)[None, :]
        else:
            groups = (ks[:, None] // GROUP_SIZE).to(tl.int64) * N + cols[None, :]
            scales = tl.load(scales_ptr + groups, mask=tile_mask, other=0.0)
            zeros = tl.load(zeros_ptr + groups, mask=tile_mask, other=0.0)
        w = ((q.to(tl.float32) - zeros) * scales).to(a.dtype)
        if IEEE_FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
           bits: int = 4) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype; the contract of `w4a16_ref.packed_matmul_ref`."""
    if bits not in (4, 8):
        raise ValueError(f"packed GEMM: {bits}-bit weights are not supported (4 and 8 are)")
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[0] * (32 // bits) < k:
        raise ValueError(f"packed GEMM: qweight {qweight.dtype} {tuple(qweight.shape)} does not hold {k} "
                         f"{bits}-bit rows")
    groups = -(-k // group_size)
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"packed GEMM: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)}, expected "
                         f"({groups}, {n})")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

    _packed_gemm_kernel[grid](out, x, qweight.contiguous(), scales.float().contiguous(), zeros.float().contiguous(),
                              m, n, k, x.stride(0), out.stride(0), BITS=bits, GROUP_SIZE=group_size,
                              IEEE_FP32=x.dtype == torch.float32)
    return out
