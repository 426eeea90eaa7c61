"""Request checks that need the model: context length, vocabulary. Messages and codes follow
OpenAI's so clients recognise them; the HTTP API maps `InvalidRequestError` to a 400 as is."""

from __future__ import annotations

from typing import Protocol

from .sampling_params import InvalidRequestError, SamplingParams

# Normalisers can merge characters (NFC: 'e' + U+0301 -> 'é', Hangul jamo 3 -> 1), so the
# character count of a prompt bounds its token count only within this factor.
_NORMALISATION_SLACK = 4


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def max_prompt_chars(max_model_len: int, longest_token_chars: int) -> int:
    """Most characters a prompt that fits the context can have: each token covers at most
    `longest_token_chars` of them (after normalisation)."""
    return max_model_len * longest_token_chars * _NORMALISATION_SLACK


def prompt_token_ids(prompt: str | list[int], tokenizer: Encoder, vocab_size: int, max_model_len: int,
                     max_chars: int, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
    """Tokenize a text prompt, or check a token-id prompt against the vocabulary.

    A text too long to fit the context whatever its tokens is refused before tokenizing
    (megabytes of text take seconds to tokenize)."""
    if isinstance(prompt, str):
        if len(prompt) > max_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{param} has {len(prompt)} characters, more than {max_model_len} tokens can hold. "
                f"Please reduce the length of the {param}.", param=param, code="context_length_exceeded")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        ids = [int(t) for t in prompt]
        check_token_ids(ids, vocab_size, param)
    if not ids:
        raise InvalidRequestError(f"the {param} is empty.", param=param)
    return ids


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{param} contains {bad}, which is out of vocabulary (size {vocab_size}).",
                                  param=param)


def check_fits(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
               vocab_size: int, param: str = "prompt") -> None:
    """Refuse what cannot fit the context, with OpenAI's `context_length_exceeded` and numbers."""
    max_tokens = params.max_tokens
    requested = num_prompt_tokens + (max_tokens or 1)
    if num_prompt_tokens >= max_model_len or requested > max_model_len:
        completion = f"{max_tokens} in the completion" if max_tokens else "at least 1 to generate"
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({num_prompt_tokens} in the {param}, {completion}). "
            f"Please reduce the length of the {param} or completion.",
            param="max_tokens" if num_prompt_tokens < max_model_len else param,
            code="context_length_exceeded")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
