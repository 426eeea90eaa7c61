"""From a validated request to engine inputs: prompt token ids and SamplingParams."""

from __future__ import annotations

from typing import Any

from ..engine.sampling_params import SamplingParams
from .protocol import SamplingRequest

# Knobs the model's generation_config may default: passed to the engine only when the
# client set them, so SamplingParams can tell "unset" from "set to the default".
_MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def sampling_params(request: SamplingRequest, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    given: dict[str, Any] = {name: getattr(request, name) for name in _MODEL_DEFAULTED
                             if name in request.model_fields_set and getattr(request, name) is not None}
    if "priority" in request.model_fields_set:   # unset: the tenant's default (server/api/tenancy.py)
        given["priority"] = request.priority
    return SamplingParams(
        n=request.n, seed=request.seed, stop=request.stop_strings,
        stop_token_ids=list(request.stop_token_ids or []), max_tokens=max_tokens,
        min_tokens=request.min_tokens, ignore_eos=request.ignore_eos, logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        cache_salt=request.cache_salt, **given)
