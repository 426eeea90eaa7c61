"""Autotune configurations, one list per kernel, sized for Hopper (H100) and Ampere (A100, A10).

Under Triton's interpreter (CPU tests) every list collapses to its first entry: timing
configs there measures Python, not the kernel, and would make CI crawl. The first entry
is therefore always the one that fits every supported GPU. On a GPU, a config whose shared
memory does not fit (e.g. the H100 ones on an A10) fails to compile and the autotuner skips it.
"""

from __future__ import annotations

from triton import Config, knobs


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1 was set before the kernels were defined."""
    return bool(knobs.runtime.interpret)


def _for_this_run(configs: list[Config]) -> list[Config]:
    return configs[:1] if interpreting() else configs


# Paged attention tile = TILE_SIZE KV tokens per loop iteration. K and V tiles of
# TILE_SIZE x head_dim fp16 are 2 * 32 * 128 * 2 B = 16 KiB per pipeline stage at TILE 32.
ATTENTION_CONFIGS = _for_this_run([
    # Fits everything, incl. Ampere consumer parts (sm_86, ~100 KiB smem): 2 stages x 16 KiB.
    Config({"TILE_SIZE": 32}, num_warps=4, num_stages=2),
    # A100 (164 KiB smem): 3 stages x 32 KiB keeps more KV bytes in flight for memory-bound decode.
    Config({"TILE_SIZE": 64}, num_warps=4, num_stages=3),
    # H100 (228 KiB smem): decode streams KV; 4 stages x 32 KiB hides HBM3 latency best.
    Config({"TILE_SIZE": 64}, num_warps=4, num_stages=4),
    # H100 prefill, head_dim 128: a 16 x 128 score tile per step needs 8 warps to keep the
    # tensor cores fed; 3 stages x 64 KiB = 192 KiB still fits 228 KiB.
    Config({"TILE_SIZE": 128}, num_warps=8, num_stages=3),
    # Small head_dim (64) or tiny blocks: short tiles, cheap to pipeline deep on both.
    Config({"TILE_SIZE": 16}, num_warps=2, num_stages=4),
    # H100 split-KV decode: each program sees one slice of a long context; 8 warps issue more
    # loads in flight per SM when only a few programs share it.
    Config({"TILE_SIZE": 64}, num_warps=8, num_stages=4),
])

# Row-wise RMSNorm holds one hidden-size row in registers: 4 warps cover <= 2048 columns
# without spilling, 8 warps 4096 (Llama-8B), 16 warps 8192 (70B) on both architectures.
RMS_NORM_CONFIGS = _for_this_run([
    Config({}, num_warps=4),
    Config({}, num_warps=8),
    Config({}, num_warps=16),
])
