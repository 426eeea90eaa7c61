"""Pipeline parallelism: each stage runs its run of decoder layers; hidden states go stage to stage.

Every rank receives the whole step (`step_broadcast`) and cuts it the same way into micro-batches
of whole sequences. Stage s runs micro-batch m while stage s+1 runs m-1: a stage sends each
micro-batch's (hidden, residual) on without waiting for the next stage to take it (`isend`).
The last stage computes the logits, gathers their vocab slices from its tensor-parallel ranks
and sends them to rank 0, so the engine sees one model that returns the step's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from ..model.families.llama import LlamaForCausalLM
from ..model.forward_batch import ForwardBatch
from .group import tensor_group
from .plan import ShardPlan


@dataclass(frozen=True)
class MicroBatch:
    batch: ForwardBatch
    tokens: int
    rows: int     # logits rows


def split_batch(batch: ForwardBatch, parts: int) -> list[MicroBatch]:
    """`parts` micro-batches of consecutive whole sequences, about equal in tokens (every rank
    computes the same cut from the host-side lengths)."""
    parts = max(1, min(parts, batch.num_seqs))
    lens = batch.query_lens_cpu
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    total = starts[-1]
    seq_bounds = [0]
    for part in range(1, parts):   # the first sequence that starts at or after part/parts of the tokens
        target = total * part / parts
        index = next((i for i in range(seq_bounds[-1] + 1, batch.num_seqs) if starts[i] >= target),
                     batch.num_seqs - (parts - part))
        seq_bounds.append(max(seq_bounds[-1] + 1, min(index, batch.num_seqs - (parts - part))))
    seq_bounds.append(batch.num_seqs)
    token_bounds = [starts[i] for i in seq_bounds]
    row_bounds = torch.searchsorted(batch.logits_indices,
                                    torch.tensor(token_bounds, device=batch.logits_indices.device)).tolist()
    micro = []
    for a, b, (ta, tb), (ra, rb) in zip(seq_bounds, seq_bounds[1:], zip(token_bounds, token_bounds[1:]),
                                        zip(row_bounds, row_bounds[1:])):
        query_lens, seq_lens = lens[a:b], batch.seq_lens_cpu[a:b]
        part = replace(
            batch, input_ids=batch.input_ids[ta:tb], positions=batch.positions[ta:tb],
            slot_mapping=batch.slot_mapping[ta:tb], block_tables=batch.block_tables[a:b],
            query_start_loc=batch.query_start_loc[a:b + 1] - ta, seq_lens=batch.seq_lens[a:b],
            logits_indices=batch.logits_indices[ra:rb] - ta, max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            adapter_indices=None if batch.adapter_indices is None else batch.adapter_indices[ta:tb])
        micro.append(MicroBatch(part, tb - ta, rb - ra))
    return micro


class StageMissing(nn.Module):
    """A module another stage holds (vLLM's PPMissingLayer): no parameters, never called."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this module belongs to another pipeline stage")


def check_stageable(model: nn.Module) -> None:
    if not isinstance(model, LlamaForCausalLM) or type(model).hidden_states is not LlamaForCausalLM.hidden_states:
        raise ValueError(f"{type(model).__name__}: pipeline parallelism supports the Llama-shaped decoder families "
                         "(Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Phi-3) only; use --pipeline-parallel-size 1")


def drop_other_stages(model: LlamaForCausalLM, plan: ShardPlan) -> None:
    """Replace the embeddings, final norm and head a stage does not hold (before sharding and loading)."""
    check_stageable(model)
    if not plan.holds_embeddings:
        model.model.embed_tokens = StageMissing()
    if not plan.last_stage:
        model.model.norm = StageMissing()
        model.lm_head = None


class PipelineStage:
    """One rank's part of a pipelined step; `compute` returns the step's float32 logits on rank 0."""

    def __init__(self, model: LlamaForCausalLM, plan: ShardPlan, dtype: torch.dtype) -> None:
        self.model, self.plan, self.dtype = model, plan, dtype

    def compute(self, batch: ForwardBatch, kv_caches: list) -> torch.Tensor | None:
        plan, decoder = self.plan, self.model.model
        previous, following = plan.global_rank - plan.size, plan.global_rank + plan.size
        hidden_size, device = self.model.config.hidden_size, batch.input_ids.device
        sends: list[dist.Work] = []
        logits: list[torch.Tensor] = []
        for index, micro in enumerate(split_batch(batch, plan.stages)):
            if plan.first_stage:
                x, residual = decoder.embed_tokens(micro.batch.input_ids), None
            else:
                x = torch.empty(micro.tokens, hidden_size, dtype=self.dtype, device=device)
                residual = torch.empty_like(x)
                dist.recv(x, previous, tag=2 * index)
                dist.recv(residual, previous, tag=2 * index + 1)
            for layer, kv_cache in zip(decoder.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, decoder.rotary_emb, kv_cache, micro.batch)
            if plan.last_stage:
                if micro.rows:
                    logits.append(self.model.logits(self.model.final_norm(x, residual, micro.batch.logits_indices)))
            else:
                sends += [dist.isend(x.contiguous(), following, tag=2 * index),
                          dist.isend(residual.contiguous(), following, tag=2 * index + 1)]
        for work in sends:
            work.wait()
        return self._logits_to_rank0(logits, int(batch.logits_indices.shape[0]), device)

    def _logits_to_rank0(self, logits: list[torch.Tensor], rows: int, device: torch.device) -> torch.Tensor | None:
        plan, vocab = self.plan, self.plan.config.vocab_size
        source = (plan.stages - 1) * plan.size   # the last stage's first rank assembles them
        if rows == 0:
            return torch.empty(0, vocab, device=device) if plan.global_rank == 0 else None
        if plan.last_stage:
            local = torch.cat(logits)
            if plan.size > 1:
                parts = [torch.empty_like(local) for _ in range(plan.size)] if plan.rank == 0 else None
                dist.gather(local, parts, dst=source, group=tensor_group())
                if parts is None:
                    return None
                local = torch.cat(parts, dim=-1)
            dist.send(local[:, :vocab].contiguous(), 0)
            return None
        if plan.global_rank != 0:
            return None
        out = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        dist.recv(out, source)
        return out
