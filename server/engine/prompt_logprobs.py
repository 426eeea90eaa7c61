"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens
before it, with the top-k alternatives, from the prefill's own logits.

Only requests that ask pay for them. The runner asks `plan` which flat-batch rows of a step are
prompt positions still owed; those rows join the rows the model computes logits for, and
`accept` takes the log-softmax of them alone. A normal decode step plans nothing and runs as
before (its recorded or captured graphs included).

A prefix-cache hit holds K/V, not logits, so a request that asks is not served from the cache
(`KVCacheManager.match_prefix`): its whole prompt is recomputed, as vLLM does. Keeping the
logits instead would cost vocab x 4 bytes a position (192 KiB for SmolLM2's 49,152 tokens,
8x its K/V); BENCHMARKS.md has the recompute's measured cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sampler import logprob_entries
from .scheduler import SchedulerOutput
from .sequence import Request

SLICE_ROWS = 256

@dataclass
class PromptSpan:
    """Rows of one step's extra logits: the next-token logits at prompt positions
    `first .. first + count - 1` of `request` (scoring tokens `first + 1 ..`)."""

    request: Request
    first: int
    count: int


@dataclass
class PromptLogprobPlan:
    rows: np.ndarray  # flat-batch rows, int64, in span order
    spans: list[PromptSpan]


class PromptLogprobs:
    """The runner's part: which rows a step owes prompt logprobs for, and their logprobs.
    Scoring that raises fails the requests it was for (`failures`, which the engine takes
    after the step), never the step."""

    def __init__(self) -> None:
        self.failures: list[tuple[Request, Exception]] = []

    @staticmethod
    def owed(out: SchedulerOutput) -> bool:
        """Whether a scheduled request still owes prompt logprobs (a decode step of requests
        that never asked reads one attribute a sequence and runs as before)."""
        return any(item.seq.request.owes_prompt_logprobs for item in out.scheduled)

    @staticmethod
    def plan(out: SchedulerOutput, query_start: np.ndarray) -> PromptLogprobPlan | None:
        """Rows of the step whose logits score a prompt token not yet scored; None for none.

        A request's entries are kept in position order: a chunk that starts past the next owed
        position (it cannot: such requests skip the prefix cache) would leave a gap, so only a
        contiguous continuation is planned. A recomputed chunk (after preemption) owes nothing."""
        rows: list[np.ndarray] = []
        spans: list[PromptSpan] = []
        for i, item in enumerate(out.scheduled):
            request = item.seq.request
            owed = request.prompt_logprobs
            if owed is None or item.seq.index != 0:
                continue
            start = item.seq.num_computed_tokens
            first = max(start, len(owed) - 1)
            end = min(start + item.num_new_tokens, len(request.prompt_token_ids) - 1)
            if end <= first or first != len(owed) - 1:
                continue
            base = int(query_start[i]) - start
            rows.append(np.arange(base + first, base + end, dtype=np.int64))
            spans.append(PromptSpan(request, first, end - first))
        if not spans:
            return None
        return PromptLogprobPlan(np.concatenate(rows), spans)

    def accept(self, logits: torch.Tensor, plan: PromptLogprobPlan) -> None:
        """Append each span's entries (top-k ids and logprobs, then the prompt token's logprob
        and rank: the sampler's `logprob_entries` form) to its request."""
        try:
            self._score(logits, plan)
        except Exception as error:  # noqa: BLE001 - pinned to the requests that asked
            self.failures += [(span.request, error) for span in plan.spans]

    @staticmethod
    def _score(logits: torch.Tensor, plan: PromptLogprobPlan) -> None:
        targets: list[int] = []
        wants: list[int] = []
        for span in plan.spans:
            targets += span.request.prompt_token_ids[span.first + 1:span.first + 1 + span.count]
            wants += [span.request.params.prompt_logprobs or 0] * span.count
        chosen = torch.tensor(targets, dtype=torch.int64, device=logits.device)
        entries = []
        for lo in range(0, len(targets), SLICE_ROWS):   # one float32 log-softmax copy of a slice at a time
            hi = lo + SLICE_ROWS
            entries += logprob_entries(logits[lo:hi], chosen[lo:hi], wants[lo:hi])
        offset = 0
        for span in plan.spans:
            owed = span.request.prompt_logprobs
            assert owed is not None
            owed += entries[offset:offset + span.count]
            offset += span.count
