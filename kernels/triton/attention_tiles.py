"""Triton building blocks shared by the unified and the split-KV paged attention kernels.

A program owns a tile of BLOCK_M query rows: BLOCK_Q consecutive tokens of one sequence
times the QUERIES_PER_KV query heads that read the same KV head (GQA packing), so one
K/V tile load serves them all. It walks KV tiles with an online softmax in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # compiled kernels may only read constexpr globals


@triton.jit
def find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose q blocks contain global block `q_block_idx`.

    Sequence i's blocks start at `query_start_loc[i] // BLOCK_Q + i`, which needs no prefix
    sum on the host and leaves at most one idle block per sequence.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def tanh(x):
    """tanh from exp2, portable across the CUDA backend and the interpreter; saturates to +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def attend_tiles(q, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                 query_pos, row_valid, seq_len, tile_lo, tile_hi, scale, softcap, sliding_window,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 head_dim, BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TILE_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Online softmax over KV tiles [tile_lo, tile_hi); returns (row max, row sum, unnormalised out).

    Scores are kept in log2 units (exp2 is the fast path). `query_pos` [BLOCK_M] holds each
    row's absolute position: a row sees keys at or before it (causal within the chunk, all of
    the cached prefix), within the window if any. An fp8 cache's values are read as q's dtype
    (exactly): its K scale belongs in `scale`, its V scale on the output.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = offs_d < head_dim
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_SIZE + tl.arange(0, TILE_SIZE)
        key_valid = key_pos < seq_len
        block = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_offs = block * stride_kb + in_block * stride_kt + kv_head * stride_kh
        v_offs = block * stride_vb + in_block * stride_vt + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_offs[None, :] + offs_d[:, None],
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)      # [D, TILE]
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)      # [TILE, D]
        k = k.to(q.dtype)   # an fp8 cache: its values exactly (its scales are the caller's)
        v = v.to(q.dtype)
        s = tl.dot(q, k)
        if USE_SOFTCAP:
            s = softcap * tanh(s * (scale / softcap)) * LOG2E
        else:
            s = s * (scale * LOG2E)
        distance = query_pos[:, None] - key_pos[None, :]
        allowed = row_valid[:, None] & key_valid[None, :] & (distance >= 0)
        if USE_WINDOW:
            allowed = allowed & (distance < sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def kv_tile_range(query_pos_first, query_pos_last, seq_len, sliding_window, split,
                  NUM_SPLITS: tl.constexpr, TILE_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr):
    """The KV tiles this program folds: those its q block can see (up to its last query, from its
    first query's window start), cut into NUM_SPLITS even slices, of which it takes `split`."""
    tile_hi = tl.cdiv(tl.minimum(seq_len, query_pos_last + 1), TILE_SIZE)
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(query_pos_first - sliding_window + 1, 0) // TILE_SIZE
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)
    return tile_lo, tile_hi


@triton.jit
def load_query_tile(q_ptr, query_start_loc_ptr, seq_lens_ptr, q_block_idx, num_seqs, kv_head,
                    stride_qt, stride_qh, head_dim, QUERIES_PER_KV: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    """Locate this program's q block and load its [BLOCK_M, D] query rows.

    Returns the rows, their absolute positions, validity, token and head indices, the
    sequence, its first/last visible query positions and `first_q >= q_len` (nothing to do).
    """
    seq_idx = find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    first_q = (q_block_idx - (q_start // BLOCK_Q + seq_idx)) * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    q_local = first_q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    first_pos = context_len + first_q
    last_pos = context_len + tl.minimum(first_q + BLOCK_Q, q_len) - 1
    return (q, context_len + q_local, row_valid, token, head, seq_idx, seq_len,
            first_pos, last_pos, first_q >= q_len)
