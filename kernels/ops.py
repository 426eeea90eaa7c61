"""The kernel API the model calls: tensors in, tensors out, Triton on CUDA, torch elsewhere.
With `ops_cpu.py` (the C kernels' named API) it is all the server imports of `kernels/`: the torch
references the model runs as such (the fp8 KV-cache conversions, the packed-int helpers of
quantized weights, the rotary tables) are named here too.

On CPU, RMSNorm, SiLU-and-mul and the rotary embedding run the fused C kernels of `fused_cpu`
when they could be built (backend "auto"); "torch" forces the pure-torch references everywhere.

`KUBEINFER_KERNEL_BACKEND` (auto | triton | torch) or the `use_backend` context manager
override the choice, e.g. to run the Triton path under TRITON_INTERPRET=1 on a CPU.
Triton modules are imported on first use, so CPU-only callers never import triton.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch

from .cpu import fused_cpu
from .reference.activation_ref import silu_and_mul_ref
from .reference.kv_cache_ref import FP8_MAX, dequantize_fp8_ref, quantize_fp8_ref, store_kv_cache_ref
from .reference.lora_ref import lora_shrink_expand_ref
from .reference.moe_ref import ExpertLinear, fused_moe_ref
from .reference.rms_norm_ref import rms_norm_ref
from .reference.rope_cache import build_rope_cache, cos_sin_table
from .reference.rotary_ref import apply_rotary_ref, rotate_signed_ref
from .reference.w4a16_ref import dequantize_kn, pack_rows, unpack_rows

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("KUBEINFER_KERNEL_BACKEND", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"KUBEINFER_KERNEL_BACKEND={_backend!r}; expected one of {', '.join(BACKENDS)}")

__all__ = ["FP8_MAX", "ExpertLinear", "apply_rotary", "build_rope_cache", "cos_sin_table", "dequantize_fp8_ref",
           "dequantize_kn", "fused_moe", "lora_shrink_expand", "pack_rows", "quantize_fp8_ref", "rms_norm",
           "rotate_signed", "silu_and_mul", "store_kv_cache_ref", "triton_paged_attention", "triton_store_kv_cache",
           "triton_w4a16_matmul", "unpack_rows", "use_backend", "uses_cpu_kernels", "uses_triton"]


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily force "triton", "torch" or "auto" for every op (process-wide)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on `tensor` run the Triton kernels under the current backend setting."""
    return _backend == "triton" or (_backend == "auto" and tensor.is_cuda)


def uses_cpu_kernels(tensor: torch.Tensor) -> bool:
    """Whether the fused C kernels (`fused_cpu`) take ops on `tensor`: CPU tensors unless "torch" is forced."""
    return _backend != "torch" and fused_cpu.available(tensor)


@lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


# Split-KV decode: programs per SM to aim for, the fewest tokens a split covers, the most splits.
# Measured on an H200 (benchmarks/gpu_tune.py; BENCHMARKS.md, "On an H200"): splits pay at long
# contexts and small batches; from batch 16 at 4k, unsplit was fastest; at 8k tokens or less the
# partials and the merge cost what the split saves.
SPLIT_PROGRAMS_PER_SM = 4
SPLIT_MIN_TOKENS = 1024
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, max_query_len: int,
                      device: torch.device) -> int:
    """Split the context only for decode whose (sequence, KV head) programs leave SMs idle.

    Aim for SPLIT_PROGRAMS_PER_SM programs per SM, each split still covering SPLIT_MIN_TOKENS
    so the merge stays cheap next to the KV reads it parallelises.
    """
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    wanted = -(-SPLIT_PROGRAMS_PER_SM * _multiprocessor_count(device) // programs)
    return max(1, min(wanted, max_seq_len // SPLIT_MIN_TOKENS, MAX_SPLITS))


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, *, max_query_len: int, max_seq_len: int,
                           sliding_window: int | None = None, softcap: float | None = None,
                           num_splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of `q [T, H, D]` over the paged caches on the Triton kernels whatever the backend
    setting (reference: `attention_ref.paged_attention_ref`): unified, or split-KV when
    `num_splits` (None: `choose_num_splits`) is above 1. `max_query_len` / `max_seq_len` are host
    ints (never read from the device). An fp8 cache holds K / k_scale and V / v_scale."""
    if num_splits is None:
        num_splits = choose_num_splits(block_tables.shape[0], k_cache.shape[2], max_seq_len, max_query_len,
                                       q.device)
    if num_splits > 1:
        from .triton.split_kv_attention import split_kv_attention
        return split_kv_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                  num_splits=num_splits, sliding_window=sliding_window, softcap=softcap,
                                  k_scale=k_scale, v_scale=v_scale)
    from .triton.unified_attention import unified_attention
    return unified_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                             max_query_len=max_query_len, sliding_window=sliding_window, softcap=softcap,
                             k_scale=k_scale, v_scale=v_scale)


def triton_store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write `k, v [T, kv_heads, D]` into the paged caches at `slot_mapping` (-1: skip) on the Triton
    kernel whatever the backend setting; an fp8 cache holds K / k_scale and V / v_scale."""
    from .triton.kv_cache import store_kv_cache
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def triton_w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int, bits: int = 4) -> torch.Tensor:
    """x [M, K] @ a 4/8-bit packed weight (GPTQ's int32 layout, a scale and zero point per group)
    on the Triton dequant-in-GEMM kernel whatever the backend setting (reference:
    `w4a16_ref.packed_matmul_ref`)."""
    from .triton.w4a16 import matmul
    return matmul(x, qweight, scales, zeros, group_size, bits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x`; with `residual`, (normed(x + residual), x + residual)."""
    if not uses_triton(x):
        if uses_cpu_kernels(x):
            return fused_cpu.rms_norm(x, weight, eps, residual)
        return rms_norm_ref(x, weight, eps, residual)
    from .triton.rms_norm import rms_norm as norm
    return norm(x, weight, eps, residual)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by `positions` with a `build_rope_cache` table; returns (q, k)."""
    if not uses_triton(q):
        return apply_rotary_ref(q, k, positions, cos_sin_cache, inplace)
    from .triton.rotary import apply_rotary as rotate
    return rotate(q, k, positions, cos_sin_cache, inplace)


def rotate_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotate_signed_ref` (transformers' rotary and roundings, per-token tables); the CPU kernel
    rotates `x [T, heads, D]` in place, so use the returned tensor, not `x`."""
    if uses_cpu_kernels(x) and fused_cpu.rows_of_heads(x):
        return fused_cpu.rotate_in_place(x, cos, signed_sin)
    return rotate_signed_ref(x, cos, signed_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x [..., 2I]` holding gate|up."""
    if not uses_triton(x):
        if uses_cpu_kernels(x):
            return fused_cpu.silu_and_mul(x)
        return silu_and_mul_ref(x)
    from .triton.activation import silu_and_mul as fused
    return fused(x)


def fused_moe(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None, weights: torch.Tensor,
              ids: torch.Tensor, expert_linear: ExpertLinear | None = None) -> torch.Tensor:
    """Top-k routed SwiGLU experts, see `moe_ref.fused_moe_ref`: the grouped torch path on CPU,
    the Triton grouped GEMM on CUDA. An `expert_linear` (prepacked or quantized experts, which
    pass no w13 / w2) computes each expert's matmuls on the grouped torch path, on any device."""
    if expert_linear is not None or not uses_triton(x):
        return fused_moe_ref(x, w13, w2, weights, ids, expert_linear)
    from .triton.moe import fused_moe as grouped
    return grouped(x, w13, w2, weights, ids)


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor,
                       slots: torch.Tensor, longest: int) -> torch.Tensor:
    """Multi-LoRA delta added in place: out += (x @ a[slot].T) @ b[slot].T per segment of rows
    sharing a slot (slot -1: none), see `lora_ref`; the Triton SGMV kernel on CUDA."""
    if not uses_triton(x):
        return lora_shrink_expand_ref(x, out, a, b, starts, slots)
    from .triton.lora import lora_shrink_expand as sgmv_lora
    return sgmv_lora(x, out, a, b, starts, slots, longest)
