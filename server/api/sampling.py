"""From a validated request to engine inputs: prompt token ids and SamplingParams."""

from __future__ import annotations

from typing import Any

from kubeinfer.server.api.errors import OpenAIError
from kubeinfer.server.api.protocol import SamplingRequest
from kubeinfer.server.engine.sampling_params import SamplingParams

# Knobs the model's generation_config may default: passed to the engine only when the
# client set them, so SamplingParams can tell "unset" from "set to the default".
_MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def sampling_params(request: SamplingRequest, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    given: dict[str, Any] = {name: getattr(request, name) for name in _MODEL_DEFAULTED
                             if name in request.model_fields_set and getattr(request, name) is not None}
    return SamplingParams(
        n=request.n, seed=request.seed, stop=request.stop_strings,
        stop_token_ids=list(request.stop_token_ids or []), max_tokens=max_tokens,
        min_tokens=request.min_tokens, ignore_eos=request.ignore_eos, logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        priority=request.priority, cache_salt=request.cache_salt, **given)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, what: str) -> None:
    """Refuse what cannot fit, with OpenAI's `context_length_exceeded` code and numbers."""
    requested = prompt_len + (max_tokens or 1)
    if prompt_len >= max_model_len or requested > max_model_len:
        completion = f"{max_tokens} in the completion" if max_tokens else "at least 1 to generate"
        raise OpenAIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({prompt_len} in the {what}, {completion}). "
            f"Please reduce the length of the {what} or completion.",
            param="max_tokens" if prompt_len < max_model_len else what,
            code="context_length_exceeded")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise OpenAIError(400, f"token id {bad} is out of range [0, {vocab_size})", param=param)
