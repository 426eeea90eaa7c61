"""CPU paged-attention decode: the C kernel of `paged_decode_cpu.c` (built by `cpu_build`).

Why not torch: on CPU, decode attention in torch must first gather each sequence's K/V out of
the paged cache into a padded copy and then run SDPA, whose CPU kernel is built for long
queries (a third of a decode step at 32 sequences; kernels/README.md has the figures). The C
kernel reads K/V in place through the block tables.
"""

from __future__ import annotations


import torch

from . import cpu_build
from ..reference.kv_cache_ref import FP8_MAX

_FUNCTIONS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


@cpu_build.per_isa
def _function(dtype: torch.dtype, fp8: bool = False):
    library = cpu_build.load("paged_decode_cpu")
    if library is None or dtype not in _FUNCTIONS:
        return None
    if fp8:
        return cpu_build.bind(library, _FUNCTIONS[dtype] + "_fp8", pointers=6, ints=9, floats=3)
    return cpu_build.bind(library, _FUNCTIONS[dtype], pointers=6, ints=8, floats=1)


def available(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether `paged_decode` runs for CPU queries of `dtype` over caches of `kv_dtype` (default:
    the same; or fp8) (builds the kernel on first call)."""
    if kv_dtype not in (None, dtype, *FP8_MAX):
        return False
    return _function(dtype, kv_dtype in FP8_MAX) is not None


def building() -> bool:
    """Whether the kernel is still compiling in the background (`cpu_build.start_building`)."""
    return cpu_build.building("paged_decode_cpu")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of one query per sequence, `q [S, H, D]` (its rows at any stride, e.g. a view into
    the fused q|k|v output), over its first `seq_lens[s]` cached tokens (the last `sliding_window` of
    them if set); returns `[S, H, D]` in q's dtype.
    `block_tables [S, max_blocks]` and `seq_lens [S]` are int32, the caches as in the README:
    of q's dtype, or fp8 holding K / k_scale and V / v_scale."""
    fp8 = k_cache.dtype in FP8_MAX
    function = _function(q.dtype, fp8)
    if function is None:
        raise RuntimeError(f"CPU decode kernel unavailable for {q.dtype}; check available() first")
    if (not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != v_cache.dtype
            or not (fp8 or k_cache.dtype == q.dtype)):
        raise ValueError("k_cache and v_cache must be contiguous and of q's dtype (or both fp8)")
    if not (q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2]):
        q = q.contiguous()   # the kernel takes any row stride, but each row's heads contiguous
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_seqs, num_heads, head_dim = q.shape
    out = q.new_empty(num_seqs, num_heads, head_dim)
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), q.stride(0), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
            tables.shape[1], sliding_window or 0)
    if fp8:
        status = function(*args, k_cache.dtype == torch.float8_e5m2, scale, k_scale, v_scale)
    else:
        status = function(*args, scale)
    if status:
        raise ValueError(f"CPU decode kernel refused the shapes (status {status}): heads {num_heads}, "
                         f"kv_heads {k_cache.shape[2]}, head_dim {head_dim}")
    return out
