"""Host-side shape checks and tile geometry shared by the paged attention launchers.

Everything here reads shapes and strides only: no device tensor is read, so a launch
never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..reference.kv_cache_ref import FP8_MAX


@dataclass(frozen=True)
class AttentionGeometry:
    """How query rows are packed into BLOCK_M-row tiles (GQA heads x BLOCK_Q tokens)."""

    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_seqs: int
    queries_per_kv: int
    block_q: int
    block_m: int

    @property
    def num_q_blocks(self) -> int:
        """Upper bound on q blocks: sequence i starts at query_start_loc[i] // block_q + i."""
        return self.num_tokens // self.block_q + self.num_seqs

    @property
    def head_dim_padded(self) -> int:
        return triton.next_power_of_2(self.head_dim)


# Query rows per tile when a step has prefill chunks. A decode tile is one token's GQA heads in
# 16 rows (the smallest tensor-core tile); a prefill tile packs more tokens so that each K/V tile
# it loads serves more rows. Measured on an H200 (benchmarks/gpu_tune.py; BENCHMARKS.md, "On an
# H200"): 64 rows were fastest for causal prefill and for a chunk over a cached prefix.
PREFILL_ROWS = 64


def attention_geometry(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       max_query_len: int = 1) -> AttentionGeometry:
    """Validate the layout contract and derive the tile shape (`max_query_len`, a host int, picks
    the prefill tile); raises ValueError on misuse."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [T, H, D] and caches [blocks, block_size, kv_heads, D], "
                         f"got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of dim {head_dim} cannot share "
                         f"{num_kv_heads} KV heads of dim {cache_head_dim}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, *FP8_MAX):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of q and of the caches must be contiguous")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [num_seqs, max_blocks] with contiguous rows")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc needs num_seqs + 1 = {num_seqs + 1} entries, "
                         f"got {query_start_loc.shape[0]}")
    queries_per_kv = num_heads // num_kv_heads
    # 16 rows is the smallest tensor-core tile; GQA groups wider than that take a tile each.
    block_m = 16 if queries_per_kv <= 16 else triton.next_power_of_2(queries_per_kv)
    if max_query_len > 1:
        block_m = max(block_m, min(PREFILL_ROWS, triton.next_power_of_2(max_query_len * queries_per_kv)))
    return AttentionGeometry(num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_seqs,
                             queries_per_kv, block_m // queries_per_kv, block_m)
