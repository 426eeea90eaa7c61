"""Autotune configurations, one list per kernel, sized for Hopper (H100) and Ampere (A100, A10).

Under Triton's interpreter (CPU tests) every list collapses to its first entry: timing
configs there measures Python, not the kernel, and would make CI crawl. The first entry
is therefore always the one that fits every supported GPU. Every config is compiled for
sm_80 and sm_90 in CI without a GPU (`compile_check.py`); should one not fit some other
part's shared memory, it fails to compile there and the autotuner skips it.
"""

from __future__ import annotations

from triton import Config, knobs


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1 was set before the kernels were defined."""
    return bool(knobs.runtime.interpret)


def _for_this_run(configs: list[Config]) -> list[Config]:
    return configs[:1] if interpreting() else configs


# Paged attention: TILE_SIZE KV tokens per loop iteration. Shared memory per program, as
# compiled for sm_80/sm_90 at head_dim 128 (`python -m kubeinfer.kernels.tools.compile_check`):
# TILE 16: 12 KiB, 32: 20 KiB, 64: 36 KiB, 128: 68 KiB; all fit sm_86 (100 KiB) up to H100 (228 KiB).
ATTENTION_CONFIGS = _for_this_run([
    # The safe default on every part, and the interpreter's config: short tiles, many resident
    # programs per SM, good for decode at high batch and for short contexts.
    Config({"TILE_SIZE": 32}, num_warps=4, num_stages=2),
    # A100 and H100 decode: twice the KV bytes per iteration halves the per-tile overhead
    # (block-table lookups, softmax rescale) that dominates a memory-bound loop.
    Config({"TILE_SIZE": 64}, num_warps=4, num_stages=3),
    # H100 (and A100) prefill at head_dim 128: a 16 x 128 score tile per step, 8 warps keep the
    # tensor cores fed; 68 KiB leaves room for 3 programs per SM on Hopper, 2 on A100.
    Config({"TILE_SIZE": 128}, num_warps=8, num_stages=3),
    # head_dim 64 or very short contexts: short tiles waste little on masked tails, and
    # 12 KiB lets many programs share an SM to hide latency.
    Config({"TILE_SIZE": 16}, num_warps=2, num_stages=4),
    # H100 split-KV decode: few programs per SM, so more warps each keep more loads in flight.
    Config({"TILE_SIZE": 64}, num_warps=8, num_stages=4),
])

# Row-wise RMSNorm holds one hidden-size row in registers: 4 warps cover <= 2048 columns
# without spilling, 8 warps 4096 (Llama-8B), 16 warps 8192 (70B) on both architectures.
RMS_NORM_CONFIGS = _for_this_run([
    Config({}, num_warps=4),
    Config({}, num_warps=8),
    Config({}, num_warps=16),
])

# MoE grouped GEMM (BLOCK_M is chosen on the host: it fixes the expert padding). Shared memory as
# compiled for sm_90 bf16 (`compile_check`), BLOCK_M 16 / 64: 5 / 8, 18 / 24, 18 / 24, 10 / 16 KiB.
MOE_CONFIGS = _for_this_run([
    # The default on every part and the interpreter's: small tiles, many programs per SM,
    # good for decode where each expert sees a handful of tokens.
    Config({"BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    # Prefill on A100/H100: wider tiles halve the reloads of the token rows.
    Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    # H100 prefill: 8 warps keep the tensor cores fed on the 64 x 128 tile.
    Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    # Narrow experts (intermediate 256-768, as Qwen3-MoE's): deeper K steps, fewer column blocks.
    Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
])

# Packed-integer GEMM (W4A16 / W8A16, `w4a16.py`): BLOCK_M is the rows of x per program, so
# decode (a few rows) wants the smallest tile the tensor cores take (16) and prefill wider ones.
# Shared memory as compiled for sm_90 bf16, group 128 (one scale row per K step): 22, 84, 46,
# 50 KiB; with per-element scales (a group size BLOCK_K does not divide) 53-210 KiB, where the
# autotuner skips what does not fit.
W4A16_CONFIGS = _for_this_run([
    # The default on every part and the interpreter's: decode-sized batches, many programs.
    Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    # Decode on A100/H100: longer K steps amortise the scale/zero loads per packed word.
    Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    # Prefill: a 64 x 128 tile dequantizes each weight tile once for 64 rows of x.
    Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    # H100 prefill: 8 warps on a 128 x 128 tile.
    Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=8, num_stages=3),
])
