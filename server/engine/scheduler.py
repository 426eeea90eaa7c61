"""Iteration-level continuous batching with chunked prefill (vLLM v1's token-budget view).

Every step gives each sequence a number of new tokens to compute: running decodes first,
then prefill chunks of partially prefilled sequences, then waiting sequences, under
`max_num_batched_tokens` and `max_num_seqs`. A decode with draft tokens (speculative decoding,
`proposer.py`) gets one position per draft too, as far as the budget goes. When blocks run out the newest running
sequence (highest priority value, latest arrival) is preempted: its blocks are freed and it
is recomputed later, cheaply when its prefix is still cached. Which waiting sequence goes
first and which running one gives way is the scheduling policy's choice
(`scheduling_policy.py`: by default priority, then arrival; or fair shares among tenants,
where a tenant short of its share may also take a slot from one holding more).

With prefix caching, a chunk's full blocks enter the prefix cache when it is scheduled, not
after it runs (as vLLM v1 does): a request scheduled later in the same step shares them at
once. That is sound because every layer stores the step's K/V before any attention reads
them, so requests sharing a system prompt that arrive together compute it once and all get
their first token from the same step.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

from .kv_cache_manager import KVCacheManager
from .scheduling_policy import PriorityPolicy, SchedulingPolicy
from .sequence import Request, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # known tokens computed this step, plus `num_drafts` draft tokens after them
    samples: bool  # this chunk reaches the end of the known tokens: sample the next one
    num_drafts: int = 0  # draft tokens scored this step (speculative decoding); each is a sampling row


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (sibling, index into `scheduled`): siblings of an n>1 request sample their first token
    # from the logits of the first sequence's last prompt chunk.
    forks: list[tuple[Sequence, int]] = field(default_factory=list)
    num_tokens: int = 0
    num_drafts: int = 0  # over all scheduled sequences; 0 = one sampling row per sampling sequence

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


Admission = Callable[[Sequence, "Scheduler"], bool]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: SchedulingPolicy | None = None, admit: "Admission | None" = None) -> None:
        """`policy` orders admission and preemption (`scheduling_policy.py`; default: priority,
        then arrival). `admit`: whether a waiting sequence may start now (LoRA: its adapter got a
        device slot, `lora.py`); one that may not is skipped this step and the sequences behind it
        are considered."""
        self.kv = kv
        self.policy = policy or PriorityPolicy()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self.num_preemptions = 0
        self.admit = admit

    @property
    def num_unfinished_seqs(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.policy.arrived(request)
        self._enqueue(request.seqs[0])

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.waiting and len(self.running) >= self.max_num_seqs:
            self._make_room()
        budget = self.max_num_batched_tokens
        preempted = False
        scheduled: set[int] = set()
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0 or len(out.scheduled) == self.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            unknown = seq.num_tokens - seq.num_computed_tokens
            num_new = min(unknown + len(seq.draft_token_ids), budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim(scheduled)
                if victim is None:
                    break
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                num_drafts = max(0, num_new - unknown)
                del seq.draft_token_ids[num_drafts:]   # those the budget leaves no room for
                self._add(out, seq, num_new, num_drafts)
                scheduled.add(id(seq))
                budget -= num_new
        candidates = self.policy.admission_order(self.waiting) if budget > 0 and not preempted else ()
        for seq in candidates:
            if (budget == 0 or len(self.running) >= self.max_num_seqs
                    or len(out.scheduled) >= self.max_num_seqs):
                break
            if self.admit is not None and not self.admit(seq, self):
                continue
            cached = self.kv.match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate_slots(seq, num_new):
                self.kv.free(seq)  # give back the matched prefix; retry next step
                break
            self.kv.record_lookup(seq.num_tokens, cached)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.num_cached_tokens = cached
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.monotonic()
            self._add(out, seq, num_new)
            budget -= num_new
        return out

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int, num_drafts: int = 0) -> None:
        samples = seq.num_computed_tokens + num_new - num_drafts == seq.num_tokens
        metrics = seq.request.metrics
        if metrics.first_token_time is None and seq.index == 0:   # a prefill chunk, for tracing
            metrics.prefill_chunks.append((time.monotonic(), num_new))
        out.scheduled.append(ScheduledSeq(seq, num_new, samples, num_drafts))
        out.num_tokens += num_new
        out.num_drafts += num_drafts
        self.policy.charge(seq, num_new)
        self.kv.cache_scheduled_blocks(seq, num_new)
        if samples and seq.index == 0:
            for sibling in seq.request.seqs[1:]:
                if sibling.status is SequenceStatus.FORK_PENDING:
                    out.forks.append((sibling, len(out.scheduled) - 1))

    def _make_room(self) -> None:
        """Every slot is taken: a waiting sequence the policy picks takes a running one's place
        in this step (fair shares among tenants), if it may start now."""
        choice = self.policy.displacement(self.waiting, self.running)
        if choice is not None and (self.admit is None or self.admit(choice[0], self)):
            self.preempt(choice[1])

    def _pick_victim(self, scheduled: set[int]) -> Sequence | None:
        """The first running sequence in the policy's preemption order not already scheduled
        this step (by default the newest of the worst priority)."""
        for seq in self.policy.preemption_order(self.running):
            if id(seq) not in scheduled:
                return seq
        return None

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it for recomputation."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.draft_token_ids = []
        self._enqueue(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> None:
        """Account for a finished forward pass: advance, cache full blocks, fork siblings. A
        sequence retired during the step (its request failed: blocks already freed) is skipped."""
        for item in out.scheduled:
            if item.seq.status is SequenceStatus.FINISHED:
                continue
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_drafts
            self.kv.cache_full_blocks(item.seq)
        for sibling, parent_index in out.forks:
            if sibling.status is SequenceStatus.FORK_PENDING:
                self.kv.fork(out.scheduled[parent_index].seq, sibling)
                sibling.status = SequenceStatus.RUNNING
                bisect.insort(self.running, sibling, key=lambda s: s.sort_key)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a speculative step: the first `num_accepted` drafts are now tokens of `seq`
        (appended by the engine) whose K/V the step computed; the blocks of the rejected rest go
        back. Call only for a sequence still running."""
        seq.draft_token_ids = []
        seq.num_computed_tokens += num_accepted
        self.kv.truncate(seq, seq.num_computed_tokens)
        self.kv.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (done or aborted) and release its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        if seq.request.finished:
            self.policy.departed(seq.request)
