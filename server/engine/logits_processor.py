"""The sampling contract's per-row hook: logits processors with per-sequence state.

A processor belongs to one sequence (n>1 siblings each get their own, built from the request's
factories). Before sampling it shapes that sequence's row of logits; after sampling it is told
the token chosen, so its state follows the sequence. The sampler calls processors only for the
rows that have them, grouped by kind, so a kind can batch its rows (a grammar fills one bitmask
for all its rows and masks them in one call); a batch without processors pays nothing.

Preemption by recompute keeps a sequence's tokens, so a processor's state stays valid across it;
a finished, aborted or failed sequence releases its processors.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import torch


class LogitsProcessor:
    """One sequence's decoding rule. Subclasses override `apply` (or `apply_rows` to batch)."""

    @classmethod
    def apply_rows(cls, logits: torch.Tensor, rows: list[int], processors: Seq["LogitsProcessor"]) -> None:
        """Shape `logits[rows[i]]` in place for `processors[i]` (all of this class)."""
        for row, processor in zip(rows, processors):
            processor.apply(logits[row])

    def apply(self, row: torch.Tensor) -> None:
        """Shape this sequence's row of logits `[vocab]` in place."""
        raise NotImplementedError

    def accept(self, token_id: int) -> None:
        """The token sampled for this sequence (raise if it breaks the rule: the request fails)."""

    def release(self) -> None:
        """The sequence is done: let go of any state it holds."""


ProcessorFactory = Callable[[], LogitsProcessor]


def apply_logits_processors(logits: torch.Tensor, per_row: Seq[Seq[LogitsProcessor]]) -> None:
    """Run every row's processors in place, one `apply_rows` call per processor kind (kinds run
    in the order they first appear)."""
    groups: dict[type[LogitsProcessor], tuple[list[int], list[LogitsProcessor]]] = {}
    for row, processors in enumerate(per_row):
        for processor in processors:
            rows, members = groups.setdefault(type(processor), ([], []))
            rows.append(row)
            members.append(processor)
    for kind, (rows, members) in groups.items():
        kind.apply_rows(logits, rows, members)
