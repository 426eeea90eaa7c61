"""Engine logprobs (one `{token_id: Logprob}` per generated token) in OpenAI's two shapes."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.outputs import Logprob
from .responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None],
                        text_offset: int, num_top: int | None = None, first_token: str = ""
                        ) -> CompletionLogprobs:
    """Legacy shape; `top_logprobs` holds the k best plus the sampled token, as vLLM does.

    `text_offset` is where the first of these tokens starts in the choice's text. An echoed
    prompt's first position has no logprobs (None): its token, `first_token`, gets nulls.
    `num_top` keeps the alternatives of rank <= it (prompt positions may carry more).
    """
    result = CompletionLogprobs()
    for token_id, alternatives in zip(token_ids, logprobs):
        if alternatives is None:
            token, logprob, top = first_token, None, None
        else:
            sampled = alternatives[token_id]
            token, logprob, top = sampled.decoded_token, sampled.logprob, {}
            for alt in sorted(alternatives.values(), key=lambda alt: alt.rank):
                if alt is sampled or num_top is None or alt.rank <= num_top:
                    top.setdefault(alt.decoded_token, alt.logprob)  # byte pieces can share a string: keep the likelier
        result.tokens.append(token)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """An echoed prompt's logprobs followed by the completion's."""
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)


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
