"""Embedding requests: a request kind whose output is its prompt's pooled hidden state.

A pooling request is scheduled like any prompt (chunked prefill, the token budget, preemption)
and finishes in the step that computes its last prompt token: no token is sampled and no decode
follows, and its blocks go back at once. The engine asks the model for the final hidden states
of the rows `Pooler.rows` names instead of logits, and `Pooler.accept` folds them into each
request's `PoolingTask` chunk by chunk, so a prompt longer than one step's budget pools the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ..model.checkpoints.pooling import PoolerConfig
from .scheduler import SchedulerOutput
from .sequence import Sequence


@dataclass(eq=False)
class PoolingTask:
    """What a pooling request asks for, and its state while its prompt is computed."""

    dimensions: int | None = None          # matryoshka truncation (checked against the model)
    partial: torch.Tensor | None = None    # mean: the sum over the chunks so far; cls: the first row
    embedding: torch.Tensor | None = None  # the result: float32 [dimensions or hidden] on the CPU


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def rows(self, out: SchedulerOutput) -> np.ndarray:
        """The flat-batch rows whose final hidden states this step needs (sequence by sequence)."""
        rows: list[int] = []
        start = 0
        kind = self.config.pooling_type
        for item in out.scheduled:
            count = item.num_new_tokens
            if kind == "mean":
                rows += range(start, start + count)
            elif kind == "last" and item.samples:
                rows.append(start + count - 1)
            elif kind == "cls" and item.seq.num_computed_tokens == 0:
                rows.append(start)
            start += count
        return np.asarray(rows, dtype=np.int64)

    def accept(self, out: SchedulerOutput, hidden: torch.Tensor) -> list[Sequence]:
        """Fold this step's rows (`rows(out)` order) into the tasks; returns the sequences whose
        prompt is now complete, their embedding set. Call before the scheduler's `update`."""
        done: list[Sequence] = []
        row = 0
        kind = self.config.pooling_type
        for item in out.scheduled:
            task = item.seq.request.pooling
            assert task is not None, "a generation request in an embedding engine"
            fresh = item.seq.num_computed_tokens == 0   # a first chunk, or a restart after preemption
            if kind == "mean":
                chunk = hidden[row:row + item.num_new_tokens].float().sum(0)
                task.partial = chunk if fresh or task.partial is None else task.partial + chunk
                row += item.num_new_tokens
            elif kind == "cls" and fresh:
                task.partial = hidden[row].float()
                row += 1
            elif kind == "last" and item.samples:
                task.partial = hidden[row].float()
                row += 1
            if item.samples:
                assert task.partial is not None
                pooled = task.partial / item.seq.num_tokens if kind == "mean" else task.partial
                task.embedding = self._finish(pooled, task.dimensions)
                task.partial = None
                done.append(item.seq)
        return done

    def _finish(self, pooled: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        """Matryoshka truncation first, then L2 normalisation (as vLLM and sentence-transformers)."""
        if dimensions is not None:
            pooled = pooled[:dimensions]
        if self.config.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.cpu()
