"""Pure-torch paged attention: the reference the Triton kernels are tested against.

It is also the CPU implementation: one dense masked attention per sequence, in float32,
over K/V gathered from that sequence's blocks. Slow on a GPU (a host sync to read the
lengths), exact everywhere.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence, `[seq_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


def attention_mask(query_positions: torch.Tensor, seq_len: int,
                   sliding_window: int | None) -> torch.Tensor:
    """`[q, seq_len]` True where a query may attend: causal, and inside the window if any.

    A window of W lets a query see itself and the W - 1 keys before it (HF/Mistral).
    """
    keys = torch.arange(seq_len, device=query_positions.device)
    distance = query_positions[:, None] - keys[None, :]
    allowed = distance >= 0
    if sliding_window is not None:
        allowed &= distance < sliding_window
    return allowed


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of `q [T, H, D]` over the paged cache; returns `[T, H, D]` in q's dtype.

    Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`; its last
    query is at position `seq_lens[i] - 1`, so the queries are the newest tokens and
    everything before them (the cached prefix) is fully visible. An fp8 cache holds K / k_scale
    and V / v_scale (per-tensor scales).
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k = (gather_kv(k_cache, block_tables[i], seq_len).float() * k_scale).repeat_interleave(group, dim=1)
        v = (gather_kv(v_cache, block_tables[i], seq_len).float() * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = attention_mask(positions, seq_len, sliding_window)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
