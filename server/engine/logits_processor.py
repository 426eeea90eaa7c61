"""The sampling contract's per-row hook: logits processors with per-sequence state.

A processor belongs to one sequence (n>1 siblings each get their own, built from the request's
factories). Before sampling it shapes that sequence's row of logits; after sampling it is told
the token chosen, so its state follows the sequence. The sampler calls processors only for the
rows that have them, grouped by kind, so a kind can batch its rows (a grammar fills one bitmask
for all its rows and masks them in one call); a batch without processors pays nothing.

Preemption by recompute keeps a sequence's tokens, so a processor's state stays valid across it;
a finished, aborted or failed sequence releases its processors.

Speculative decoding: a sequence is drafted only if all its processors are `speculative`. Such a
processor checks deterministic drafts before they are scored (`validate_drafts`: the prefix it
allows), shapes the row of each draft position as it stands after the drafts before it
(`at_drafts`), and after verification is told only the tokens kept, through `accept`.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import torch


class LogitsProcessor:
    """One sequence's decoding rule. Subclasses override `apply` (or `apply_rows` to batch)."""

    # whether its sequence may be drafted: `validate_drafts` and `at_drafts` work
    speculative = False

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

    def validate_drafts(self, token_ids: list[int]) -> int:
        """How many leading draft `token_ids` (after the sequence's tokens) the rule allows,
        as the sequence's state stands (a speculative processor only). A processor that raises
        here gets no drafts, and must raise again when its row is sampled (its request fails)."""
        raise NotImplementedError

    def at_drafts(self, token_ids: list[int]) -> "LogitsProcessor":
        """The processor of the row after the sequence's tokens and the drafts `token_ids`
        (a speculative processor only; of its own class, so the rows batch together)."""
        raise NotImplementedError


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
