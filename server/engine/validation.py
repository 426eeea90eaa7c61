"""Request checks that need the model: context length, vocabulary. Messages follow vLLM/OpenAI
wording so clients recognise them."""

from __future__ import annotations

from typing import Protocol

from .sampling_params import InvalidRequestError, SamplingParams


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def prompt_token_ids(prompt: str | list[int], tokenizer: Encoder, vocab_size: int) -> list[int]:
    """Tokenize a text prompt, or check a token-id prompt against the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is out of vocabulary "
                                      f"(size {vocab_size}).")
    if not ids:
        raise InvalidRequestError("the prompt is empty.")
    return ids


def check_fits(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
               vocab_size: int) -> None:
    limit, length = max_model_len, num_prompt_tokens
    if length >= limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {length} input tokens, leaving no room for output. Please shorten it.")
    if params.max_tokens is not None and length + params.max_tokens > limit:
        raise InvalidRequestError(
            f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context "
            f"length is {limit} tokens and your request has {length} input tokens "
            f"({params.max_tokens} > {limit} - {length}).")
    for token in params.stop_token_ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"stop_token_ids contains {token}, which is not a token "
                                      f"of this model (vocabulary size {vocab_size}).")
