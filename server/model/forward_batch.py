"""The contract between the engine (who schedules) and the model (who computes).

One step of the engine is one forward pass over a flat batch of tokens: prefill chunks
and decode tokens of many sequences packed together (vLLM v1's "unified" batch). The
scheduler fills this once per step; the model and the attention backend only read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Flat batch of `T` tokens from `S` sequences, sequence by sequence.

    KV cache layout (per layer): `k_cache`, `v_cache` of shape
    `[num_blocks, block_size, num_kv_heads, head_dim]`; slot `s` is block `s // block_size`,
    offset `s % block_size`.
    """

    input_ids: torch.Tensor        # [T] int64 token ids
    positions: torch.Tensor        # [T] int64 absolute positions (for rotary)
    slot_mapping: torch.Tensor     # [T] int64 flat cache slot each token's K/V is written to; -1 = skip
    block_tables: torch.Tensor     # [S, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32 cumulative query (new-token) lengths
    seq_lens: torch.Tensor         # [S] int32 context length after this step (cached + new)
    logits_indices: torch.Tensor   # [L] int64 rows of the flat batch that need logits
    max_query_len: int             # host-side copies: no device sync to read them
    max_seq_len: int
    # Host-side mirrors of query_start_loc and seq_lens, for CPU backends that loop in Python.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # [T] int32 LoRA adapter slot of each token; None = every token on the base weights (always,
    # until adapters exist: the LoRA layers read it, the engine fills it from `Request.adapter`)
    adapter_indices: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
