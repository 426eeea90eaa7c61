"""Builders for ragged paged-attention batches, shaped like the engine's ForwardBatch fields."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (new tokens, cached prefix) per sequence. Prefixes of 15/33/23 end mid-block.
BATCH_KINDS: dict[str, list[tuple[int, int]]] = {
    "prefill": [(7, 0), (19, 0), (1, 0)],
    "decode": [(1, 0), (1, 15), (1, 33), (1, 50)],
    "mixed": [(9, 23), (1, 40), (16, 0), (1, 7)],
}


@dataclass
class PagedBatch:
    q: torch.Tensor                # [T, H, D]
    k_cache: torch.Tensor          # [num_blocks, block_size, KVH, D]; unused slots hold NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [S, max_blocks] int32, unordered, padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor         # [S] int32
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc, self.seq_lens)


def make_paged_batch(lengths: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, seed: int = 0, spare_blocks: int = 5) -> PagedBatch:
    """Random q and caches; blocks drawn in shuffled order from a pool whose last block is used.

    Cache slots no sequence owns are NaN, so any read past a sequence's end poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q_len + prefix for q_len, prefix in lengths]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    pool = torch.randperm(num_blocks - 1, generator=gen)[: sum(blocks_needed) - 1].tolist()
    pool.insert(len(pool) // 2, num_blocks - 1)   # a block at the very end of the pool
    block_tables = torch.zeros(len(lengths), max(blocks_needed), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, (seq_len, count) in enumerate(zip(seq_lens, blocks_needed)):
        block_tables[i, :count] = torch.tensor(pool[:count], dtype=torch.int32)
        pool = pool[count:]
        slots = torch.arange(seq_len)
        blocks = block_tables[i].long()[slots // block_size]
        k_cache[blocks, slots % block_size] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[blocks, slots % block_size] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    query_lens = [q_len for q_len, _ in lengths]
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(q, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32),
                      max(query_lens), max(seq_lens))
