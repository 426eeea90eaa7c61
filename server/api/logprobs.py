"""Engine logprobs (one `{token_id: Logprob}` per generated token) in OpenAI's two shapes."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.outputs import Logprob
from .responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                        text_offset: int) -> CompletionLogprobs:
    """Legacy shape; `top_logprobs` holds the k best plus the sampled token, as vLLM does.

    `text_offset` is where the first of these tokens starts in the choice's text.
    """
    result = CompletionLogprobs()
    for token_id, alternatives in zip(token_ids, logprobs):
        sampled = alternatives[token_id]
        result.tokens.append(sampled.decoded_token)
        result.token_logprobs.append(sampled.logprob)
        top: dict[str, float] = {}
        for alt in sorted(alternatives.values(), key=lambda alt: alt.rank):
            top.setdefault(alt.decoded_token, alt.logprob)  # byte pieces can share a string: keep the likelier
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(sampled.decoded_token)
    return result


def _top(token: Logprob) -> TopLogprob:
    return TopLogprob(token=token.decoded_token, logprob=token.logprob,
                      bytes=list(token.decoded_token.encode("utf-8")))


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]],
                  num_top: int) -> ChatLogprobs:
    """Chat shape: each token with its `num_top` best alternatives ordered by rank."""
    content = []
    for token_id, alternatives in zip(token_ids, logprobs):
        top = sorted((alt for alt in alternatives.values() if alt.rank <= num_top),
                     key=lambda alt: alt.rank)
        sampled = _top(alternatives[token_id])
        content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=[_top(alt) for alt in top]))
    return ChatLogprobs(content=content)
