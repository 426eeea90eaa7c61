"""Paged attention behind one interface: a batched torch path for CPU (Triton serves CUDA).

On CPU, decode tokens (one query per sequence) go to the C kernel of
`kernels/cpu/paged_decode_cpu.py`, which reads K/V in place through the block tables. With bf16,
head_dim 64/128 and AMX (and no sliding window), every other sequence (fresh prompts and chunks
after a cached prefix) goes to the flash-attention kernel of `kernels/cpu/paged_prefill_cpu.py`,
also reading K/V through the block tables. Otherwise (and while a starting server still compiles those kernels) prefill
chunks, and decodes where the decode kernel is unavailable, take the padded torch
path: K/V of each sequence's context are gathered from the paged cache by its block table into
a padded `[S, max_seq_len, kv_heads, d]` tensor; queries are padded to
`[S, max_query_len, heads, d]`; one boolean mask encodes causality against the cached prefix
and padding (and the sliding window of Mistral and Gemma's local layers); and one `scaled_dot_product_attention`
call (GQA via `enable_gqa`) does the math for each group of sequences with similar query
lengths: a 200-token chunk in one call with fifteen 32-token chunks would pad them all to 200
queries (3,200 rows for 680 tokens). A prefill without cached prefix attends causally over
its own k/v instead, one `is_causal` SDPA call per run of adjacent equally long prompts: no
cache read, no padding and no mask, and half the scores (a masked call computes the upper
triangle too). Decode-only batches need no query padding. K/V of the step
are stored first: rows copied by the C kernel of `fused_cpu`, else one `index_copy_` over
`slot_mapping`.
Attention soft-capping (Gemma 2) is not in SDPA nor in the C kernels: a soft-capping backend
runs every sequence through the padded path with the scores computed, capped and masked
explicitly. Sliding windows are in the decode kernel; windowed prefill takes the padded path.
Gathers use `index_select` and GQA `enable_gqa` (both faster than the alternatives; the
measurements behind these choices are in kernels/README.md).
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F

from kubeinfer.kernels import ops, ops_cpu
from kubeinfer.kernels.ops import FP8_MAX, dequantize_fp8_ref, quantize_fp8_ref, store_kv_cache_ref

from ..forward_batch import ForwardBatch
from .kv_cache_quant import KVScales
from .rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    def rotate(self, qk: torch.Tensor, num_heads: int, rotary: RotaryEmbedding, batch: ForwardBatch
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [T, heads + kv_heads, d] rotated by `batch.positions`, split into q [T, heads, d]
        and k; the rotary form (per-step cos/sin, or a table the kernel indexes) is the backend's."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] after rotary; stores k/v at `batch.slot_mapping`
        (skipping -1) and returns [T, heads, d]. An fp8 cache (`kv_scales` set) holds k / kv_scales.k
        and v / kv_scales.v, and every query attends over those stored values (this step's too)."""
        ...

    def for_layer(self, sliding_window: int | None, softcap: float | None) -> "AttentionBackend":
        """A backend of the same kind for layers with their own window / score soft-cap (Gemma's
        interleaved local and global layers)."""
        ...


@dataclass
class _PaddedGroup:
    """Sequences attended together in one padded SDPA call, with their index tensors."""

    rows: slice | torch.Tensor         # their tokens' rows in the flat batch
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    context_blocks: torch.Tensor       # [S * blocks_per_seq] block ids, int64
    key_mask: torch.Tensor             # [S, 1, max_query_len, max_seq_len] bool, True = attend
    query_index: torch.Tensor | None   # [T] flat index into the padded [S * max_query_len] queries


@dataclass
class _DecodeGroup:
    """Single-query sequences for the CPU decode kernel."""

    rows: slice | torch.Tensor
    block_tables: torch.Tensor         # [S, max_blocks] int32
    seq_lens: torch.Tensor             # [S] int32


@dataclass
class _PrefillGroup:
    """Sequences with several queries (or all, without the decode kernel) for the CPU prefill
    kernel, which reads their K/V through the block tables."""
    rows: slice | torch.Tensor
    block_tables: torch.Tensor         # [S, max_blocks] int32
    seq_lens: torch.Tensor             # [S] int32
    query_lens: torch.Tensor           # [S] int32
    query_starts: torch.Tensor         # [S] int32, into the group's own rows


@dataclass
class _FreshRun:
    """`count` adjacent prefills of one length, none with a cached prefix: their rows
    [start, start + count * length) go through one batched causal SDPA call (faster than one
    call each)."""

    start: int
    length: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.count * self.length)


@dataclass
class _StepLayout:
    """Index tensors derived once per ForwardBatch and shared by every layer of the step."""

    store_slots: torch.Tensor          # slots to write (the -1 entries removed)
    store_rows: torch.Tensor | None    # rows of k/v to write; None = all rows
    decode: _DecodeGroup | None
    prefill: _PrefillGroup | None      # the prefill kernel's sequences; then fresh and padded are empty
    fresh: list[_FreshRun]             # prefills without cached prefix: causal over their own k/v
    padded: list[_PaddedGroup]         # by query length, see _similar_query_lengths


def _rows(seqs: list[int], starts: list[int], query_lens: list[int], device: torch.device
          ) -> slice | torch.Tensor:
    rows = [row for i in seqs for row in range(starts[i], starts[i] + query_lens[i])]
    if rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, device=device)


def _subset(tensor: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return tensor if index is None else tensor.index_select(0, index)


def _padded_group(batch: ForwardBatch, seqs: list[int], starts: list[int], block_size: int,
                  sliding_window: int | None) -> _PaddedGroup:
    device = batch.input_ids.device
    query_lens_cpu = [batch.query_lens_cpu[i] for i in seqs]
    seq_lens_cpu = [batch.seq_lens_cpu[i] for i in seqs]
    num_seqs, max_q, max_len = len(seqs), max(query_lens_cpu), max(seq_lens_cpu)
    index = None if num_seqs == batch.num_seqs else torch.tensor(seqs, device=device)
    seq_lens = _subset(batch.seq_lens, index).to(dtype=torch.int64)
    query_lens = torch.tensor(query_lens_cpu, device=device, dtype=torch.int64)
    key_pos = torch.arange(max_len, device=device)
    query_pos = torch.arange(max_q, device=device)
    # Query i of a sequence with context L and q new tokens sees keys j <= L - q + i (and j < L).
    last_visible = (seq_lens - query_lens)[:, None] + query_pos[None, :]
    key_mask = (key_pos[None, None, :] <= last_visible[:, :, None]) & (key_pos < seq_lens[:, None, None])
    if sliding_window is not None:   # Mistral-style: a query sees only the last `sliding_window` positions
        key_mask &= key_pos[None, None, :] > last_visible[:, :, None] - sliding_window
    query_index = None
    if max_q > 1:
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
        first_row = torch.cumsum(query_lens, 0) - query_lens
        query_index = (seq_of_token * max_q + torch.arange(sum(query_lens_cpu), device=device)
                       - first_row[seq_of_token])
    tables = _subset(batch.block_tables, index)
    return _PaddedGroup(
        rows=_rows(seqs, starts, batch.query_lens_cpu, device),
        num_seqs=num_seqs, max_query_len=max_q, max_seq_len=max_len,
        context_blocks=tables[:, :-(-max_len // block_size)].to(torch.int64).reshape(-1),
        key_mask=key_mask[:, None],
        query_index=query_index,
    )


def _decode_group(batch: ForwardBatch, seqs: list[int], starts: list[int]) -> _DecodeGroup:
    device = batch.input_ids.device
    index = None if len(seqs) == batch.num_seqs else torch.tensor(seqs, device=device)
    tables = _subset(batch.block_tables, index)
    return _DecodeGroup(rows=_rows(seqs, starts, batch.query_lens_cpu, device),
                        block_tables=tables.to(torch.int32).contiguous(),
                        seq_lens=_subset(batch.seq_lens, index).to(torch.int32).contiguous())


def _prefill_group(batch: ForwardBatch, seqs: list[int], starts: list[int]) -> _PrefillGroup:
    device = batch.input_ids.device
    index = None if len(seqs) == batch.num_seqs else torch.tensor(seqs, device=device)
    query_lens = [batch.query_lens_cpu[i] for i in seqs]
    query_starts = [0, *itertools.accumulate(query_lens)][:-1]
    return _PrefillGroup(rows=_rows(seqs, starts, batch.query_lens_cpu, device),
                         block_tables=_subset(batch.block_tables, index).to(torch.int32).contiguous(),
                         seq_lens=_subset(batch.seq_lens, index).to(torch.int32).contiguous(),
                         query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
                         query_starts=torch.tensor(query_starts, dtype=torch.int32, device=device))


def _similar_query_lengths(seqs: list[int], query_lens: list[int]) -> list[list[int]]:
    """`seqs` in groups (each in batch order) whose queries, padded to the group's longest, are
    at most twice their real count: one SDPA call per group."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(seqs, key=lambda i: query_lens[i]):
        if groups and (len(groups[-1]) + 1) * query_lens[i] <= 2 * (total + query_lens[i]):
            groups[-1].append(i)
            total += query_lens[i]
        else:
            groups.append([i])
            total = query_lens[i]
    return [sorted(group) for group in groups]


def _layout(batch: ForwardBatch, block_size: int, sliding_window: int | None,
            decode_kernel: bool, prefill_kernel: bool, causal_sdpa: bool = True) -> _StepLayout:
    valid = batch.slot_mapping >= 0
    all_valid = bool(valid.all())
    starts = [0]
    for length in batch.query_lens_cpu:
        starts.append(starts[-1] + length)
    decodes, fresh, rest = [], [], []
    # The prefill kernel reads this step's K/V from the cache: every row must have been stored.
    prefill_kernel = prefill_kernel and all_valid and sliding_window is None
    for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_cpu, batch.seq_lens_cpu)):
        if decode_kernel and query_len == 1:
            decodes.append(i)
        elif prefill_kernel:
            rest.append(i)
        elif (causal_sdpa and query_len == seq_len and all_valid   # the cache holds nothing else it could attend to
              and (sliding_window is None or seq_len <= sliding_window)):
            if fresh and fresh[-1].length == query_len and fresh[-1].rows.stop == starts[i]:
                fresh[-1].count += 1
            else:
                fresh.append(_FreshRun(starts[i], query_len, 1))
        else:
            rest.append(i)
    return _StepLayout(
        store_slots=batch.slot_mapping if all_valid else batch.slot_mapping[valid],
        store_rows=None if all_valid else valid.nonzero().squeeze(1),
        decode=_decode_group(batch, decodes, starts) if decodes else None,
        prefill=_prefill_group(batch, rest, starts) if prefill_kernel and rest else None,
        fresh=fresh,
        padded=[] if prefill_kernel else [_padded_group(batch, group, starts, block_size, sliding_window)
                                          for group in _similar_query_lengths(rest, batch.query_lens_cpu)],
    )


def _decide_kernel(choice: bool | None, q: torch.Tensor, cache: torch.Tensor, kind: str) -> bool | None:
    """Whether the CPU attention kernel of `kind` ("decode", "prefill") serves these queries and
    cache: `choice` once decided; None (torch now, decided at a later step) while a starting
    server still compiles it."""
    if choice is not None:
        return choice
    if cache.device.type != "cpu":
        return False
    return ops_cpu.attention_kernel(kind, q.dtype, cache.dtype, cache.shape[-1])


class TorchAttention:
    """Batched paged attention on CPU: see the module docstring.

    Index tensors are derived on the first layer of a step and reused by the others, keyed on
    the ForwardBatch object: the engine builds a new ForwardBatch per step (never mutates one).
    `decode_kernel`: send single-query sequences to the C decode kernel (default: when it is
    available for the cache's dtype on this machine). While a starting server still compiles
    it, decodes take the torch path: a fresh pod's first tokens do not wait 5-8 s for gcc.
    `prefill_kernel`: likewise for every other sequence and the C prefill kernel (default:
    when it is available for the cache's dtype and head size).
    `softcap`: scores become `softcap * tanh(score / softcap)` (Gemma 2); neither SDPA nor the C
    kernels can, so every sequence then takes the padded path with explicit scores.
    """

    def __init__(self, sliding_window: int | None = None, decode_kernel: bool | None = None,
                 prefill_kernel: bool | None = None, softcap: float | None = None) -> None:
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.decode_kernel = False if softcap is not None else decode_kernel
        self.prefill_kernel = False if softcap is not None else prefill_kernel
        self._batch: ForwardBatch | None = None
        self._layout: _StepLayout | None = None

    def rotate(self, qk: torch.Tensor, num_heads: int, rotary: RotaryEmbedding, batch: ForwardBatch
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k heads rotated together (one set of ops instead of two) by cos and signed sin
        of this step's positions (computed once a step, `RotaryEmbedding.step_cos_sin`)."""
        q, k = ops.rotate_signed(qk, *rotary.step_cos_sin(batch, qk.dtype)).split(
            [num_heads, qk.shape[1] - num_heads], dim=1)
        return q, k

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if batch is not self._batch:   # first layer of a new step
            self._batch = batch
            self.decode_kernel = _decide_kernel(self.decode_kernel, q, k_cache, "decode")
            self.prefill_kernel = _decide_kernel(self.prefill_kernel, q, k_cache, "prefill")
            self._layout = _layout(batch, k_cache.shape[1], self.sliding_window, bool(self.decode_kernel),
                                   bool(self.prefill_kernel), causal_sdpa=self.softcap is None)
        layout = self._layout
        kv = (kv_scales or KVScales()) if k_cache.dtype in FP8_MAX else None
        self._store(k, v, k_cache, v_cache, batch.slot_mapping, layout, kv)
        if kv is not None and layout.fresh:   # fresh prompts attend over their k/v as the cache holds them
            k, v = (dequantize_fp8_ref(quantize_fp8_ref(x, s, k_cache.dtype), s, x.dtype) for x, s in ((k, kv.k), (v, kv.v)))
        decode, padded, prefill = layout.decode, layout.padded, layout.prefill
        if decode is None and prefill is not None:   # then fresh and padded are empty too
            return self._prefill(q, k_cache, v_cache, prefill, scale, kv)
        if prefill is None and not padded and not layout.fresh:
            return self._decode(q, k_cache, v_cache, decode, scale, kv)
        if decode is None and not layout.fresh and len(padded) == 1:
            return self._padded(q, k, v, k_cache, v_cache, padded[0], scale, kv)
        if decode is None and not padded and len(layout.fresh) == 1:
            return self._causal(q, k, v, scale, layout.fresh[0].count)
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.rows] = self._decode(q[decode.rows], k_cache, v_cache, decode, scale, kv)
        if prefill is not None:
            out[prefill.rows] = self._prefill(q[prefill.rows], k_cache, v_cache, prefill, scale, kv)
        for run in layout.fresh:
            out[run.rows] = self._causal(q[run.rows], k[run.rows], v[run.rows], scale, run.count)
        for group in padded:
            out[group.rows] = self._padded(q[group.rows], k[group.rows], v[group.rows], k_cache, v_cache,
                                           group, scale, kv)
        return out

    def for_layer(self, sliding_window: int | None, softcap: float | None) -> "TorchAttention":
        return TorchAttention(sliding_window, self.decode_kernel, self.prefill_kernel, softcap)

    @staticmethod
    def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, count: int) -> torch.Tensor:
        """`count` equally long whole prompts, rows one after the other, each attending causally
        over its own k/v."""
        def heads_first(x: torch.Tensor) -> torch.Tensor:   # [count * L, H, D] -> [count, H, L, D]
            return x.view(count, -1, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(q.shape)

    @staticmethod
    def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _PrefillGroup,
                 scale: float, kv: KVScales | None) -> torch.Tensor:
        return ops_cpu.paged_prefill(q, k_cache, v_cache, group.block_tables, group.seq_lens, group.query_lens,
                                     group.query_starts, scale, *((kv.k, kv.v) if kv else ()))

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                group: _DecodeGroup, scale: float, kv: KVScales | None) -> torch.Tensor:
        return ops_cpu.paged_decode(q, k_cache, v_cache, group.block_tables, group.seq_lens,
                                    scale, self.sliding_window, *((kv.k, kv.v) if kv else ()))

    def _padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, group: _PaddedGroup, scale: float, kv: KVScales | None) -> torch.Tensor:
        num_seqs, max_q, max_len = group.num_seqs, group.max_query_len, group.max_seq_len
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        keys = self._gather(k_cache, group, num_seqs, max_len)
        values = self._gather(v_cache, group, num_seqs, max_len)
        if kv is not None:
            keys, values = dequantize_fp8_ref(keys, kv.k, q.dtype), dequantize_fp8_ref(values, kv.v, q.dtype)
        if group.query_index is None:   # decode-only: one query per sequence, already in order
            queries = q[:, None]
        else:
            queries = q.new_zeros(num_seqs * max_q, heads, head_dim).index_copy_(0, group.query_index, q)
            queries = queries.view(num_seqs, max_q, heads, head_dim)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=group.key_mask,
                                                 scale=scale, enable_gqa=heads != kv_heads)
        else:
            out = _softcapped_attention(queries.transpose(1, 2), keys, values, group.key_mask, scale, self.softcap)
        out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, head_dim)
        return out if group.query_index is None else out.index_select(0, group.query_index)

    @staticmethod
    def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, layout: _StepLayout, kv: KVScales | None) -> None:
        if kv is not None:   # fp8: quantized on the way in
            if ops.uses_cpu_kernels(k) and ops_cpu.same_rows(k, v):
                ops_cpu.store_kv_fp8(k, v, k_cache, v_cache, slot_mapping, kv.k, kv.v)
            else:
                store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, kv.k, kv.v)
            return
        if ops.uses_cpu_kernels(k) and ops_cpu.same_rows(k, v):
            ops_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)   # rows copied in place, -1 skipped
            return
        if layout.store_rows is not None:
            k, v = k.index_select(0, layout.store_rows), v.index_select(0, layout.store_rows)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, layout.store_slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, layout.store_slots, v)

    @staticmethod
    def _gather(cache: torch.Tensor, group: _PaddedGroup, num_seqs: int, max_len: int) -> torch.Tensor:
        """[S, kv_heads, max_len, d] contexts read from the paged cache through the block tables."""
        context = cache.index_select(0, group.context_blocks)
        context = context.view(num_seqs, -1, *cache.shape[2:])[:, :max_len]
        return context.transpose(1, 2)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float) -> torch.Tensor:
    """Attention of q [S, H, Q, d] over k/v [S, KVH, L, d] with `softcap * tanh(score / softcap)`
    scores (as transformers' Gemma 2), `mask` [S, 1, Q, L] True = attend; softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def get_attention_backend(device: torch.device, sliding_window: int | None = None) -> AttentionBackend:
    """The torch path on CPU; on CUDA the Triton backend once `attention_triton.py` exists.
    `sliding_window`: attend to the last N positions only (Mistral); None = full causal attention."""
    if device.type == "cuda":
        # Selection point for the Triton kernels: used as soon as attention_triton.py exists.
        if importlib.util.find_spec(f"{__package__}.attention_triton") is not None:
            from .attention_triton import TritonAttention

            return TritonAttention(sliding_window=sliding_window)
    return TorchAttention(sliding_window)
