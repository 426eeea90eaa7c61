"""Request and sequence state: what the scheduler moves between queues.

A request with `n` completions owns `n` sequences. Only the first is prefilled; the others
fork from it when its prompt is done, sharing the prompt's full KV blocks by reference.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kv_events import ExtraKey
from .logits_processor import LogitsProcessor, ProcessorFactory
from .outputs import Logprob, RequestMetrics
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from .detokenizer import IncrementalDetokenizer
    from .pooler import PoolingTask


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted and to be recomputed
    RUNNING = "running"
    FORK_PENDING = "fork_pending"  # a sibling waiting for the first sequence's prompt
    FINISHED = "finished"


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    seqs: list["Sequence"] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit of the first scheduling
    aborted: bool = False
    error: str | None = None  # why handling it failed (it then finished with "error")
    client_error: bool = False  # the failure is the request's own (InvalidRequestError), not the server's
    # each sequence builds its own processors from these (e.g. a grammar matcher)
    processor_factories: list[ProcessorFactory] = field(default_factory=list)
    adapter: str | None = None  # LoRA adapter name; None = the base weights (no adapters yet)
    tenant: str = ""  # whose request it is, for fair scheduling (`scheduling_policy.py`); "" = anonymous
    pooling: "PoolingTask | None" = None  # an embedding request (`pooler.py`): no tokens are generated
    extra_key: ExtraKey = field(init=False)  # the prefix-cache namespace of its blocks
    # with params.prompt_logprobs: one entry per prompt position scored so far (the first has no
    # context: None), in the sampler's logprob-entry form (`prompt_logprobs.py` fills it)
    prompt_logprobs: list[tuple[list[int], list[float], float, int] | None] | None = field(init=False)
    decoded_prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # the same, once all are in

    def __post_init__(self) -> None:
        self.extra_key = ExtraKey(self.params.cache_salt, self.adapter)
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None
        self.seqs = [Sequence(self, i) for i in range(self.params.n)]
        for sibling in self.seqs[1:]:
            sibling.status = SequenceStatus.FORK_PENDING

    @property
    def finished(self) -> bool:
        return all(seq.status is SequenceStatus.FINISHED for seq in self.seqs)

    @property
    def owes_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt positions are not scored yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens a sequence may generate."""
        limit = self.max_model_len
        if self.params.max_tokens is not None:
            limit = min(limit, len(self.prompt_token_ids) + self.params.max_tokens)
        return limit


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    num_inserted_blocks: int = 0  # leading blocks already handed to the prefix cache
    # leading blocks out of every layer's sliding window, given back (`KVCacheManager._release_out_of_window`)
    num_released_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    detokenizer: "IncrementalDetokenizer | None" = None
    num_sent_tokens: int = 0  # output tokens already reported to the caller
    draft_token_ids: list[int] = field(default_factory=list)  # a proposer's guesses after token_ids
    # [drafts, vocab]: the distribution each draft was sampled from (a draft model's), for
    # rejection sampling; None = deterministic drafts (n-gram, suffix), kept when equal to the sample
    draft_probs: torch.Tensor | None = None
    logits_processors: list[LogitsProcessor] = field(init=False)

    def __post_init__(self) -> None:
        self.logits_processors = [make() for make in self.request.processor_factories]
        self.token_ids = list(self.request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        if self.request.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority (lower first), then arrival, then completion index."""
        return (self.request.params.priority, self.request.arrival_order, self.index)


@dataclass(eq=False)
class DraftPosition:
    """A sampling row after `seq`'s tokens and its first `num_drafts` draft tokens: one of the
    positions a speculative step verifies. To the sampler it reads like the sequence there."""

    seq: Sequence
    num_drafts: int

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.seq.draft_token_ids[:self.num_drafts]

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.draft_token_ids[:self.num_drafts]

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.num_drafts

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def logits_processors(self) -> list[LogitsProcessor]:
        """The sequence's processors as they stand after the drafts before this position (only
        speculative processors' sequences are drafted: `Speculator.draft`)."""
        drafts = self.seq.draft_token_ids[:self.num_drafts]
        return [processor.at_drafts(drafts) for processor in self.seq.logits_processors]


SamplingRow = Sequence | DraftPosition   # one row of logits the sampler turns into a token
