"""CPU paged-attention prefill on AMX or AVX512-BF16: the C kernel of `paged_prefill_cpu.c` (built by `cpu_build`).

Why not torch: its CPU SDPA reaches ~160 GFLOP/s on prompts of a few hundred tokens, and a chunk
after a cached prefix needs a gathered, padded copy of the sequence's K/V plus a mask first. The
kernel reads K/V through the block tables and computes only the causal half, with AMX tiles or
AVX512-BF16 dot products.
"""

from __future__ import annotations


import torch

from . import cpu_build, quant_linear_cpu
from ..reference.kv_cache_ref import FP8_MAX

HEAD_DIMS = (64, 128)


@cpu_build.per_isa
def _function(fp8: bool = False):
    library = cpu_build.load("paged_prefill_cpu")
    if library is None:
        return None
    kind = cpu_build.bind(library, "paged_prefill_kind", pointers=0, ints=0)()   # 0 none, 1 AVX512-BF16, 2 AMX
    if kind == 0 or (kind == 2 and not quant_linear_cpu.amx_available()):   # the process's AMX permission
        return None
    if fp8:
        return cpu_build.bind(library, "paged_prefill_bf16_fp8", pointers=8, ints=8, floats=3)
    return cpu_build.bind(library, "paged_prefill_bf16", pointers=8, ints=7, floats=1)


def available(dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether `paged_prefill` runs here for CPU queries of this dtype and head size over caches
    of `kv_dtype` (default: the same; or fp8) (builds the kernel on first call; needs AMX or
    AVX512-BF16)."""
    return (dtype == torch.bfloat16 and head_dim in HEAD_DIMS and kv_dtype in (None, dtype, *FP8_MAX)
            and _function(kv_dtype in FP8_MAX) is not None)


def building() -> bool:
    """Whether the kernel is still compiling in the background (`cpu_build.start_building`)."""
    return cpu_build.building("paged_prefill_cpu")


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_lens: torch.Tensor, query_starts: torch.Tensor,
                  scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's last `query_lens[s]` positions, whose queries are rows
    `query_starts[s]...` of `q [T, H, D]`, over its first `seq_lens[s]` cached tokens (this
    step's K/V already stored); returns `[T, H, D]`. Index tensors are int32, caches as in the
    README: of q's dtype, or fp8 holding K / k_scale and V / v_scale."""
    fp8 = k_cache.dtype in FP8_MAX
    function = _function(fp8)
    if function is None or not available(q.dtype, q.shape[2], k_cache.dtype):
        raise RuntimeError(f"CPU prefill kernel unavailable for {q.dtype}, head_dim {q.shape[2]}; check available()")
    if (not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != v_cache.dtype
            or not (fp8 or k_cache.dtype == q.dtype)):
        raise ValueError("k_cache and v_cache must be contiguous and of q's dtype (or both fp8)")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:   # rows may be strided (a view of fused qkv)
        q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens, query_lens, query_starts = (t.to(torch.int32).contiguous() for t in (seq_lens, query_lens, query_starts))
    out = q.new_empty(q.shape[0], q.shape[1], q.shape[2])
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            query_lens.data_ptr(), query_starts.data_ptr(), out.data_ptr(), q.stride(0), tables.shape[1],
            lens.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])
    if fp8:
        status = function(*args, k_cache.dtype == torch.float8_e5m2, scale, k_scale, v_scale)
    else:
        status = function(*args, scale)
    if status:
        raise ValueError(f"CPU prefill kernel refused the shapes (status {status}): heads {q.shape[1]}, "
                         f"kv_heads {k_cache.shape[2]}, head_dim {q.shape[2]}")
    return out
