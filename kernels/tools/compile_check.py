"""`python -m kubeinfer.kernels.tools.compile_check`: compile every kernel and autotune config for
Ampere (sm_80) and Hopper (sm_90) on a machine without a GPU.

The interpreter tests prove the math; this proves the kernels are valid *compiled* Triton
(constexpr globals, dtypes, shared-memory budgets), which the interpreter never checks.
Triton's bundled ptxas does the last step, so no CUDA device or driver is needed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

TYPES = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class CompileCase:
    name: str
    kernel: Any                                   # a @triton.jit function
    pointers: dict[str, str]                      # argument -> Triton pointer type, e.g. "*bf16"
    constexprs: dict[str, Any]
    floats: frozenset[str] = frozenset()          # float scalars; other scalars are i32
    options: dict[str, int] = field(default_factory=lambda: {"num_warps": 4, "num_stages": 3})
    min_arch: int = 0                             # e.g. 89: Triton has fp8 e4m3 from Ada on


def cases(dtype: str) -> Iterator[CompileCase]:
    """Every kernel at Llama-3-8B-like shapes (32 query / 8 KV heads, head_dim 128), every config."""
    from ..triton import (activation, kv_cache, lora, moe, rms_norm, rotary, split_kv_attention,
                          unified_attention, w4a16)
    from ..triton.attention_launch import PREFILL_ROWS
    from ..triton.tuning import ATTENTION_CONFIGS, MOE_CONFIGS, RMS_NORM_CONFIGS, W4A16_CONFIGS

    p = "*" + TYPES[dtype]
    attention = dict(lse_ptr="*fp32", q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, block_tables_ptr="*i32",
                     query_start_loc_ptr="*i32", seq_lens_ptr="*i32")
    for cfg in ATTENTION_CONFIGS:
        # unified GQA decode and prefill tiles; split-KV decode with window and soft-cap
        for splits, block_m in ((1, 16), (1, PREFILL_ROWS), (4, 16)):
            constexprs = dict(QUERIES_PER_KV=4, BLOCK_Q=block_m // 4, BLOCK_M=block_m, HEAD_DIM_PADDED=128,
                              BLOCK_SIZE=16, NUM_SPLITS=splits, WRITE_LSE=splits > 1, USE_SOFTCAP=splits > 1,
                              USE_WINDOW=splits > 1, IS_DECODE=block_m == 16, **cfg.kwargs)
            yield CompileCase(f"attention {cfg.kwargs} warps={cfg.num_warps} stages={cfg.num_stages} "
                              f"splits={splits} rows={block_m}", unified_attention._paged_attention_kernel.fn,
                              dict(attention, out_ptr="*fp32" if splits > 1 else p), constexprs,
                              frozenset({"scale", "v_scale", "softcap"}),
                              {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    yield CompileCase("merge splits", split_kv_attention._merge_splits_kernel,
                      dict(out_ptr=p, partial_out_ptr="*fp32", partial_lse_ptr="*fp32"),
                      dict(NUM_SPLITS=5, SPLITS_PADDED=8, HEAD_DIM_PADDED=128))
    store = dict(k_ptr=p, v_ptr=p, k_cache_ptr=p, v_cache_ptr=p, slot_mapping_ptr="*i64")
    plain = dict(QUANTIZE=False, MANTISSA_BITS=0, SUBNORMAL_MAGIC=1.0, MIN_NORMAL=1.0, LARGEST=0.0)
    yield CompileCase("kv store", kv_cache._store_kv_kernel, store,
                      dict(BLOCK_SIZE=16, HEADS_PADDED=8, HEAD_DIM_PADDED=128, **plain))
    # --kv-cache-dtype fp8 (e4m3: Triton has it from sm_89 on) and fp8_e5m2
    for name, kind, bits, exponent, largest, arch in (("e4m3", "fp8e4nv", 3, -6, 448.0, 89),
                                                      ("e5m2", "fp8e5", 2, -14, 57344.0, 0)):
        fp8_cache = dict(k_cache_ptr="*" + kind, v_cache_ptr="*" + kind)
        yield CompileCase(f"attention, fp8 {name} cache", unified_attention._paged_attention_kernel.fn,
                          dict(attention, out_ptr=p, **fp8_cache),
                          dict(QUERIES_PER_KV=4, BLOCK_Q=4, BLOCK_M=16, HEAD_DIM_PADDED=128, BLOCK_SIZE=16,
                               NUM_SPLITS=1, WRITE_LSE=False, USE_SOFTCAP=False, USE_WINDOW=False, IS_DECODE=False,
                               **ATTENTION_CONFIGS[0].kwargs),
                          frozenset({"scale", "v_scale", "softcap"}), min_arch=arch)
        yield CompileCase(f"kv store into an fp8 {name} cache", kv_cache._store_kv_kernel, dict(store, **fp8_cache),
                          dict(BLOCK_SIZE=16, HEADS_PADDED=8, HEAD_DIM_PADDED=128, QUANTIZE=True, MANTISSA_BITS=bits,
                               SUBNORMAL_MAGIC=2.0 ** (23 + exponent - bits), MIN_NORMAL=2.0 ** exponent,
                               LARGEST=largest), frozenset({"k_inv_scale", "v_inv_scale"}), min_arch=arch)
    for cfg in RMS_NORM_CONFIGS:
        for residual in (False, True):
            yield CompileCase(f"rms_norm warps={cfg.num_warps} residual={residual}", rms_norm._rms_norm_kernel.fn,
                              dict(out_ptr=p, residual_out_ptr=p, x_ptr=p, residual_ptr=p, weight_ptr=p),
                              dict(HAS_RESIDUAL=residual, BLOCK=8192), frozenset({"eps"}),
                              {"num_warps": cfg.num_warps, "num_stages": 3})
    yield CompileCase("rotary", rotary._rotary_kernel,
                      dict(q_ptr=p, k_ptr=p, positions_ptr="*i64", cos_sin_ptr="*fp32"),
                      dict(Q_HEADS_PADDED=32, K_HEADS_PADDED=8, HALF_PADDED=64))
    yield CompileCase("silu_and_mul", activation._silu_and_mul_kernel, dict(out_ptr=p, x_ptr=p), dict(BLOCK=1024))
    for cfg in MOE_CONFIGS:
        for block_m, down in ((16, False), (64, True)):   # decode gate|up; prefill down with router weights
            yield CompileCase(f"moe grouped gemm {cfg.kwargs} warps={cfg.num_warps} stages={cfg.num_stages} "
                              f"block_m={block_m}", moe._grouped_gemm_kernel.fn,
                              dict(c_ptr=p, a_ptr=p, b_ptr=p, weights_ptr="*fp32", slots_ptr="*i32",
                                   block_experts_ptr="*i32"),
                              dict(ROWS_PER_A=1 if down else 2, MUL_WEIGHTS=down, BLOCK_M=block_m, **cfg.kwargs),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    for cfg in W4A16_CONFIGS:
        for bits, group_size in ((4, 128), (8, 4104)):   # W4A16 by groups; W8A16 by channel, K % BLOCK_K != 0
            yield CompileCase(f"packed gemm {bits}-bit group {group_size} {cfg.kwargs} warps={cfg.num_warps} "
                              f"stages={cfg.num_stages}", w4a16._packed_gemm_kernel.fn,
                              dict(c_ptr=p, a_ptr=p, qweight_ptr="*i32", scales_ptr="*fp32", zeros_ptr="*fp32"),
                              dict(BITS=bits, GROUP_SIZE=group_size, IEEE_FP32=False, **cfg.kwargs),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    for block_m in (16, 64):   # decode (one row per segment) and prefill segments
        for expand in (False, True):   # shrink into float32 [T, R]; expand adds into the layer's output
            yield CompileCase(f"lora sgmv {'expand' if expand else 'shrink'} block_m={block_m}", lora._sgmv_kernel,
                              dict(x_ptr="*fp32" if expand else p, w_ptr=p, out_ptr=p if expand else "*fp32",
                                   starts_ptr="*i32", slots_ptr="*i32"),
                              dict(ACCUMULATE=expand, BLOCK_M=block_m, BLOCK_N=64 if expand else 16,
                                   BLOCK_K=16 if expand else 64))


def compile_case(case: CompileCase, arch: int) -> int:
    """Compile down to a cubin for `sm_{arch}`; returns the shared memory the kernel needs, in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {name: "constexpr" if name in case.constexprs else case.pointers.get(name) or
                 ("fp32" if name in case.floats else "i32") for name in case.kernel.arg_names}
    source = ASTSource(case.kernel, signature, constexprs=case.constexprs)
    return compile(source, target=GPUTarget("cuda", arch, 32), options=case.options).metadata.shared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="SM versions, e.g. 80 90")
    parser.add_argument("--dtype", nargs="+", default=list(TYPES), choices=list(TYPES))
    args = parser.parse_args(argv)
    from ..triton.tuning import interpreting

    if interpreting():
        print("compile_check: unset TRITON_INTERPRET; the interpreter compiles nothing", file=sys.stderr)
        return 2
    failures = 0
    for arch in args.arch:
        for dtype in args.dtype:
            for case in cases(dtype):
                if arch < case.min_arch:
                    print(f"skip  sm_{arch} {dtype:<9} {case.name}: needs sm_{case.min_arch}")
                    continue
                try:
                    print(f"ok    sm_{arch} {dtype:<9} {case.name}: {compile_case(case, arch) / 1024:.0f} KiB smem")
                except Exception as error:   # report every failure, not just the first
                    failures += 1
                    print(f"FAIL  sm_{arch} {dtype:<9} {case.name}: {type(error).__name__}: {error}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
