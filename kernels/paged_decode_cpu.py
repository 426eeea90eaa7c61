"""CPU paged-attention decode: the C kernel of `paged_decode_cpu.c` (built by `cpu_build`).

Why not torch: on CPU, decode attention in torch must first gather each sequence's K/V out of
the paged cache into a padded copy and then run SDPA, whose CPU kernel is built for long
queries (a third of a decode step at 32 sequences; kernels/README.md has the figures). The C
kernel reads K/V in place through the block tables.
"""

from __future__ import annotations


import torch

from . import cpu_build

_FUNCTIONS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


@cpu_build.per_isa
def _function(dtype: torch.dtype):
    library = cpu_build.load("paged_decode_cpu")
    if library is None or dtype not in _FUNCTIONS:
        return None
    return cpu_build.bind(library, _FUNCTIONS[dtype], pointers=6, ints=7, floats=1)


def available(dtype: torch.dtype) -> bool:
    """Whether `paged_decode` runs for CPU tensors of `dtype` (builds the kernel on first call)."""
    return _function(dtype) is not None


def building() -> bool:
    """Whether the kernel is still compiling in the background (`cpu_build.start_building`)."""
    return cpu_build.building("paged_decode_cpu")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query per sequence, `q [S, H, D]`, over its first `seq_lens[s]` cached
    tokens (the last `sliding_window` of them if set); returns `[S, H, D]` in q's dtype.
    `block_tables [S, max_blocks]` and `seq_lens [S]` are int32, the caches as in the README."""
    function = _function(q.dtype)
    if function is None:
        raise RuntimeError(f"CPU decode kernel unavailable for {q.dtype}; check available() first")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != q.dtype:
        raise ValueError("k_cache and v_cache must be contiguous and of q's dtype")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    status = function(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                      out.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
                      tables.shape[1], sliding_window or 0, scale)
    if status:
        raise ValueError(f"CPU decode kernel refused the shapes (status {status}): heads {num_heads}, "
                         f"kv_heads {k_cache.shape[2]}, head_dim {head_dim}")
    return out
