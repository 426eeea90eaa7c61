"""The CPU C kernels the server calls, beside the device-generic ops of `ops.py`: their build
state, the weight forms they pack once (GGUF tiles, int8 panels, LoRA slots) and the ops that
only the CPU has a kernel for. The server imports this module, never `kernels/cpu/` itself; each
function looks its kernel up at call time, so the kernel modules stay the one place to replace
(a test's spy) or to read.
"""

from __future__ import annotations

import torch

from .cpu import cpu_build, fused_cpu, int8_linear_cpu, lora_cpu, paged_decode_cpu, paged_prefill_cpu, quant_linear_cpu
from .cpu.int8_linear_cpu import PackedInt8
from .cpu.lora_cpu import LoRASlots
from .cpu.quant_linear_cpu import BLOCK_BYTES as GGUF_BLOCK_BYTES
from .cpu.quant_linear_cpu import QuantizedWeight as GGUFTiles

__all__ = ["GGUFTiles", "GGUF_BLOCK_BYTES", "LoRASlots", "PackedInt8", "any_kernel_building", "apply_token_bitmask",
           "attention_kernel", "gguf_can_pack", "gguf_dequantize", "gguf_kernel_available", "gguf_kernel_is_faster",
           "gguf_linear", "gguf_pack", "int8_amx_silu_fits", "int8_amx_takes", "int8_kernel_ready", "int8_linear",
           "int8_linear_silu_and_mul", "int8_pack", "int8_quantize_rows",
           "int8_rescale", "int8_rescale_silu_and_mul", "lora_blocked_b_shape", "lora_compact_b", "lora_kernel_ready",
           "lora_token_order", "paged_decode", "paged_prefill", "recording_calls", "same_rows", "sample_rows",
           "sample_rows_available", "start_building", "store_kv", "store_kv_fp8", "token_bitmask_available"]


# Build state

def start_building(loading_only: bool = False) -> None:
    """Compile the kernels in the background: all, or only those a model load runs (started
    while torch imports, so a fresh pod's load does not wait for gcc)."""
    cpu_build.start_building(cpu_build.LOADING_KERNELS if loading_only else cpu_build.KERNELS)


def any_kernel_building() -> bool:
    """Whether some kernel still compiles in the background (its callers take torch's path meanwhile)."""
    return any(map(cpu_build.building, cpu_build.KERNELS))


# the kernel calls made on this thread inside a `with` block, to replay
recording_calls = cpu_build.recording_calls


# GGUF block-quantized linears (Q4_0, Q4_1, Q8_0; bf16 activations)

def gguf_kernel_available() -> bool:
    """Whether GGUF quantized linears run here (kernel built, CPU with AVX512-BF16)."""
    return quant_linear_cpu.available()


def gguf_can_pack(qtype: str, out_features: int, in_features: int) -> bool:
    return quant_linear_cpu.can_pack(qtype, out_features, in_features)


def gguf_pack(qtype: str, blocks: torch.Tensor) -> GGUFTiles:
    """GGUF blocks uint8 [out, in/32, block bytes] of `qtype` -> the kernel's tiles (at load)."""
    return quant_linear_cpu.pack(qtype, blocks)


def gguf_kernel_is_faster(rows: int) -> bool:
    """Whether x of this many rows runs faster on the tiles than on the dense bf16 GEMM."""
    return quant_linear_cpu.faster_than_dense(rows)


def gguf_linear(x: torch.Tensor, tiles: GGUFTiles, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [rows, in] @ W.T + bias` in bf16 on the tiles."""
    return quant_linear_cpu.linear(x, tiles, bias)


def gguf_dequantize(qtype: str, blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks of `qtype` -> bf16 [rows, cols], the values of a float32 dequantization rounded."""
    return quant_linear_cpu.dequantize(qtype, blocks, rows, cols)


# W8A8 int8 linears

def int8_kernel_ready() -> bool:
    """Whether the int8 kernel runs here now (built, not compiling, CPU with AVX512-VNNI)."""
    return not int8_linear_cpu.building() and int8_linear_cpu.available()


def int8_pack(weight: torch.Tensor, scale: torch.Tensor) -> PackedInt8:
    return int8_linear_cpu.pack(weight, scale)


def int8_amx_takes(rows: int, in_features: int) -> bool:
    """Whether the int8 kernel runs these rows on AMX tiles here (measured per machine at first use)."""
    return int8_linear_cpu.amx_takes(rows, in_features)


def int8_linear(x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None = None,
                input_scale: torch.Tensor | None = None, use_amx: bool = False) -> torch.Tensor:
    """x [M, K] @ the packed weight with int8 activations (per token, or the static `input_scale`),
    on AMX tiles with `use_amx` (where `int8_amx_takes`)."""
    return int8_linear_cpu.linear(x, weight, bias, input_scale, use_amx)


def int8_amx_silu_fits(weight: PackedInt8) -> bool:
    """Whether a gate|up weight that `int8_amx_takes` can run with the SiLU fused (`int8_linear_silu_and_mul`)."""
    return int8_linear_cpu.amx_silu_fits(weight)


def int8_linear_silu_and_mul(x: torch.Tensor, weight: PackedInt8, input_scale: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """silu_and_mul(x @ the packed gate|up weight) in bf16, on AMX tiles, in one call."""
    return int8_linear_cpu.linear_silu_and_mul(x, weight, input_scale)


def int8_quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return int8_linear_cpu.quantize_rows(x, input_scale)


def int8_rescale(products: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    return int8_linear_cpu.rescale(products, x_scale, w_scale, dtype)


def int8_rescale_silu_and_mul(products: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return int8_linear_cpu.rescale_silu_and_mul(products, x_scale, w_scale)


# Paged attention and the KV cache

def attention_kernel(kind: str, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool | None:
    """Whether the "decode" or "prefill" attention kernel serves queries of `dtype` over caches of
    `kv_dtype`; None while a starting server still compiles it (ask again at a later step)."""
    if kind == "decode":
        return None if paged_decode_cpu.building() else paged_decode_cpu.available(dtype, kv_dtype=kv_dtype)
    return None if paged_prefill_cpu.building() else paged_prefill_cpu.available(dtype, head_dim, kv_dtype=kv_dtype)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query per sequence over its cached tokens, read in place (`paged_decode_cpu`)."""
    return paged_decode_cpu.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                         k_scale, v_scale)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_lens: torch.Tensor, query_starts: torch.Tensor, scale: float,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's new positions over its cached tokens (`paged_prefill_cpu`)."""
    return paged_prefill_cpu.paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_lens, query_starts,
                                           scale, k_scale, v_scale)


def same_rows(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `store_kv` takes these k and v (same rows, each row's heads contiguous)."""
    return fused_cpu.same_rows(k, v)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    fused_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    fused_cpu.store_kv_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# Multi-LoRA

def lora_kernel_ready(dtype: torch.dtype) -> bool:
    """Whether `LoRASlots.add` runs for `dtype` now (built, not compiling)."""
    return not lora_cpu.building() and lora_cpu.available(dtype)


def lora_blocked_b_shape(num_slots: int, out_features: int, max_rank: int) -> tuple[int, int, int, int, int]:
    return lora_cpu.blocked_b_shape(num_slots, out_features, max_rank)


def lora_compact_b(b: torch.Tensor, bounds: list[int], max_rank: int) -> torch.Tensor:
    return lora_cpu.compact_b(b, bounds, max_rank)


def lora_token_order(slots_per_token: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return lora_cpu.token_order(slots_per_token, num_slots)


# Logits: sampling and grammar masks

def sample_rows_available(logits: torch.Tensor) -> bool:
    return fused_cpu.sample_rows_available(logits)


def sample_rows(logits: torch.Tensor, rows: list[int], temperatures: list[float],
                uniform: torch.Tensor) -> torch.Tensor:
    """Temperature-only sampling of the listed rows in one pass (`fused_cpu.sample_rows`)."""
    return fused_cpu.sample_rows(logits, rows, temperatures, uniform)


def token_bitmask_available(logits: torch.Tensor) -> bool:
    return fused_cpu.token_bitmask_available(logits)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Mask the listed rows in place; returns which of them kept a finite logit."""
    return fused_cpu.apply_token_bitmask(logits, bitmask, rows)
