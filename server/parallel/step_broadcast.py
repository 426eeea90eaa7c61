"""The scheduler's decision for one step, sent from rank 0 to the workers as two tensor broadcasts.

A fixed 9-integer header (command and sizes), then one int64 tensor holding every ForwardBatch
tensor back to back: no pickling, and O(tokens + block-table entries) bytes per step. Between
steps, a LORA command tells the workers to fill a LoRA device slot from an adapter directory
(header: command, slot, path length; then the UTF-8 path; an empty path clears the slot).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.forward_batch import ForwardBatch

STOP, STEP, LORA = 0, 1, 2
# command, tokens, seqs, block-table width, logit rows, max query len, max seq len, num blocks, adapters
_HEADER = 9


def _header(device: torch.device) -> torch.Tensor:
    return torch.zeros(_HEADER, dtype=torch.int64, device=device)


def send_step(batch: ForwardBatch, num_blocks: int) -> None:
    """Rank 0: announce and send this step's batch."""
    tables = batch.block_tables
    adapters = batch.adapter_indices
    header = torch.tensor([STEP, batch.num_tokens, batch.num_seqs, tables.shape[1], batch.logits_indices.shape[0],
                           batch.max_query_len, batch.max_seq_len, num_blocks, adapters is not None], dtype=torch.int64)
    dist.broadcast(header.to(batch.input_ids.device), src=0)
    parts = [batch.input_ids, batch.positions, batch.slot_mapping, tables.reshape(-1).long(),
             batch.query_start_loc.long(), batch.seq_lens.long(), batch.logits_indices.long()]
    payload = torch.cat(parts if adapters is None else [*parts, adapters.long()])
    dist.broadcast(payload, src=0)


def send_lora_slot(slot: int, path: str | None, device: torch.device) -> None:
    """Rank 0: every worker fills LoRA slot `slot` from the adapter at `path` (None: clears it)."""
    data = (path or "").encode()
    header = _header(device)
    header[:3] = torch.tensor([LORA, slot, len(data)])
    dist.broadcast(header, src=0)
    if data:
        dist.broadcast(torch.tensor(list(data), dtype=torch.int64, device=device), src=0)


def send_stop(device: torch.device) -> None:
    dist.broadcast(_header(device), src=0)


def receive_step(device: torch.device) -> tuple[ForwardBatch, int] | tuple[int, str | None] | None:
    """Workers: the next step's batch and the KV-cache size in blocks, a LoRA slot to fill
    (slot, adapter path or None), or None when rank 0 stops."""
    header = _header(device)
    dist.broadcast(header, src=0)
    command, tokens, seqs, width, rows, max_query_len, max_seq_len, num_blocks, adapters = header.tolist()
    if command == STOP:
        return None
    if command == LORA:
        slot, length = tokens, seqs
        if not length:
            return slot, None
        data = torch.empty(length, dtype=torch.int64, device=device)
        dist.broadcast(data, src=0)
        return slot, bytes(data.tolist()).decode()
    adapter_tokens = tokens if adapters else 0
    payload = torch.empty(3 * tokens + seqs * width + 2 * seqs + 1 + rows + adapter_tokens, dtype=torch.int64,
                          device=device)
    dist.broadcast(payload, src=0)
    ids, positions, slots, tables, starts, seq_lens, logits_indices, adapter_indices = payload.split(
        [tokens, tokens, tokens, seqs * width, seqs + 1, seqs, rows, adapter_tokens])
    starts_cpu = starts.tolist()
    batch = ForwardBatch(
        input_ids=ids, positions=positions, slot_mapping=slots,
        block_tables=tables.view(seqs, width).int(), query_start_loc=starts.int(), seq_lens=seq_lens.int(),
        logits_indices=logits_indices, max_query_len=max_query_len, max_seq_len=max_seq_len,
        query_lens_cpu=[b - a for a, b in zip(starts_cpu, starts_cpu[1:])], seq_lens_cpu=seq_lens.tolist(),
        adapter_indices=adapter_indices.int() if adapters else None)
    return batch, num_blocks
