"""Drive a model through a paged KV cache step by step, as the engine does, without the engine.

Blocks are handed out in a shuffled order so block tables are never contiguous, which is what
exposes gather/scatter bugs in attention backends.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kubeinfer.server.model.forward_batch import ForwardBatch


def scattered_batch(seqs: list[tuple[int, int]], *, block_size: int, num_blocks: int, seed: int = 1,
                    skip_rows: frozenset[int] = frozenset()) -> tuple[ForwardBatch, list[list[int]]]:
    """One step for sequences given as (cached tokens, new tokens), with their blocks scattered over the
    pool; `skip_rows` get slot -1. Returns the batch and each sequence's block table."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    slots, positions, tables, query_lens, seq_lens = [], [], [], [], []
    for cached, new in seqs:
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        for pos in range(cached, cached + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
        tables.append(table)
        query_lens.append(new)
        seq_lens.append(cached + new)
    slots = [-1 if row in skip_rows else slot for row, slot in enumerate(slots)]
    return _forward_batch([0] * len(slots), positions, slots, tables, query_lens, seq_lens,
                          list(range(len(slots))), torch.device("cpu")), tables


def _forward_batch(ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                   query_lens: list[int], seq_lens: list[int], logits_rows: list[int],
                   device: torch.device) -> ForwardBatch:
    width = max(len(table) for table in tables)
    tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=device)  # noqa: E731
    return ForwardBatch(
        input_ids=tensor(ids, torch.int64), positions=tensor(positions, torch.int64),
        slot_mapping=tensor(slots, torch.int64),
        block_tables=tensor([table + [0] * (width - len(table)) for table in tables], torch.int32),
        query_start_loc=tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], torch.int32),
        seq_lens=tensor(seq_lens, torch.int32), logits_indices=tensor(logits_rows, torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


@dataclass
class _Sequence:
    length: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        config = model.config
        param = next(model.parameters())
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.model, self.block_size, self.device = model, block_size, param.device
        self.kv_caches = [(torch.zeros(shape, dtype=param.dtype, device=param.device),
                           torch.zeros(shape, dtype=param.dtype, device=param.device))
                          for _ in range(config.num_hidden_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.sequences: dict[str, _Sequence] = {}

    def share_prefix(self, source: str, seq_id: str, num_tokens: int) -> None:
        """Start `seq_id` on the first `num_tokens` (whole blocks) of `source`'s cache, as a
        prefix-cache hit does: the same blocks, not a copy."""
        assert num_tokens % self.block_size == 0 and seq_id not in self.sequences
        self.sequences[seq_id] = _Sequence(num_tokens, self.sequences[source].blocks[:num_tokens // self.block_size])

    def build_batch(self, chunks: list[tuple[str, list[int]]], all_logits: bool = False) -> ForwardBatch:
        """One step: `chunks` = (sequence id, new token ids) per sequence, in batch order."""
        ids, positions, slots, tables, query_lens, seq_lens, logits_rows = [], [], [], [], [], [], []
        for seq_id, tokens in chunks:
            seq = self.sequences.setdefault(seq_id, _Sequence())
            for pos in range(seq.length, seq.length + len(tokens)):
                if pos // self.block_size == len(seq.blocks):
                    seq.blocks.append(self.free_blocks.pop())
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            start = len(ids)
            ids.extend(tokens)
            logits_rows.extend(range(start, len(ids)) if all_logits else [len(ids) - 1])
            seq.length += len(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(seq.length)
            tables.append(list(seq.blocks))
        return _forward_batch(ids, positions, slots, tables, query_lens, seq_lens, logits_rows, self.device)

    def step(self, chunks: list[tuple[str, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """float32 logits: the last token of each chunk, or every token with `all_logits`."""
        with torch.inference_mode():
            return self.model(self.build_batch(chunks, all_logits), self.kv_caches)


def assert_stepwise_parity(model: torch.nn.Module, hf_model: torch.nn.Module, prompt: list[int],
                           continuation: list[int], atol: float) -> None:
    """A prefill of `prompt`, then one decode step per `continuation` token, through the paged
    runner and through transformers' own cache, chunk for chunk: rope variants that rescale by
    sequence length (dynamic NTK, LongRoPE) are compared at the same step boundaries."""
    chunks = [prompt] + [[token] for token in continuation]
    runner = PagedRunner(model, num_blocks=32)
    ours = torch.cat([runner.step([("a", chunk)], all_logits=True) for chunk in chunks])
    cache, reference = None, []
    with torch.no_grad():
        for chunk in chunks:
            out = hf_model(torch.tensor([chunk]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            reference.append(out.logits[0])
    torch.testing.assert_close(ours, torch.cat(reference), atol=atol, rtol=0)
