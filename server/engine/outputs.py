"""What the engine hands back per request, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    delta_text: str  # new since the previous RequestOutput of this request
    delta_token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # cumulative, one dict per generated token
    finish_reason: str | None  # None while running, then "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None  # the stop string / stop token id that ended it


@dataclass
class RequestMetrics:
    """time.monotonic() stamps; None until the event happens."""

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # for the tracing spans (server/api/tracing.py): when each prefill chunk before the first
    # token was scheduled and its prompt tokens; the speculative tokens verified and accepted
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None  # set (with finished) when handling this request failed
    client_error: bool = False  # `error` is the request's own fault: the client's message, a 400
    # a pooling request's result (float32, CPU; `outputs` is then empty); None while running or if aborted
    embedding: "torch.Tensor | None" = None
    # with prompt_logprobs, once the whole prompt is scored: per prompt position (the first is
    # None) the prompt token and the top-k alternatives, as vLLM's RequestOutput.prompt_logprobs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
