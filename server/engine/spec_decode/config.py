"""`--speculative-config`: vLLM's JSON shape, validated once, with our two adaptive knobs.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}
    {"model": "/models/small", "num_speculative_tokens": 4}      (method draft_model)

vLLM's older spellings are accepted too: `"model": "[ngram]"` / `"method": "[ngram]"`. Pure
Python (no torch): the flag table and the operator import it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
_NGRAM_SPELLINGS = ("ngram", "[ngram]")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft and when. Field names are vLLM's where vLLM has the knob."""

    method: str
    num_speculative_tokens: int
    # ngram: the last n tokens (longest n first) are looked up earlier in prompt + output
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: a smaller model with the same tokenizer (a directory or .gguf, as --model)
    model: str | None = None
    # suffix: Arctic Inference's knobs (vLLM's names)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    # ours: the shared trie's bound in tokens (at most depth nodes a token, ~240 bytes a node)
    suffix_decoding_max_cached_tokens: int = 20_000
    # ours: a sequence's own trie holds the substrings starting in its last this many tokens
    # (prompt and output; at most this x depth nodes, ~12 MB at the defaults)
    suffix_decoding_max_request_tokens: int = 2048
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # adaptive: no drafts in a step with more running sequences than this (vLLM's
    # disable_by_batch_size; None = always draft). Measured in BENCHMARKS.md.
    disable_by_batch_size: int | None = 8
    # adaptive, per sequence: stop drafting while the moving average of accepted drafts per
    # drafted token is below this, and try again every `acceptance_retry_steps` steps
    min_acceptance_rate: float = 0.2
    acceptance_retry_steps: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be an integer in [1, 64], "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = 5   # vLLM's default
            low, high = low if low is not None else high, high if high is not None else low
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
            if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high <= 64):
                raise ValueError("prompt_lookup_min and prompt_lookup_max must be integers with "
                                 f"1 <= min <= max <= 64, got {low!r} and {high!r}")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"prompt_lookup_min/max apply to method ngram, not {self.method}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs 'model': the draft model's directory or .gguf")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"'model' names a draft model; method {self.method} takes none")
        if (self.suffix_decoding_max_tree_depth < 2 or self.suffix_decoding_max_cached_requests < 0
                or self.suffix_decoding_max_cached_tokens < 0):
            raise ValueError("suffix_decoding_max_tree_depth must be >= 2 and "
                             "suffix_decoding_max_cached_requests/tokens >= 0")
        if self.suffix_decoding_max_request_tokens < self.suffix_decoding_max_tree_depth:
            raise ValueError("suffix_decoding_max_request_tokens must be >= suffix_decoding_max_tree_depth "
                             f"({self.suffix_decoding_max_tree_depth}), got {self.suffix_decoding_max_request_tokens}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0 or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1] and "
                             "suffix_decoding_max_spec_factor > 0")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0 or self.acceptance_retry_steps < 1:
            raise ValueError("min_acceptance_rate must be in [0, 1] and acceptance_retry_steps >= 1")

    def to_json(self) -> str:
        """The flag's value again (the keys given, normalised), for `kubeinfer serve` arguments."""
        values = asdict(self)
        defaults = {f.name: f.default for f in fields(self)}
        return json.dumps({k: v for k, v in values.items()
                           if k in ("method", "num_speculative_tokens") or v != defaults[k]},
                          separators=(",", ":"))

    def __str__(self) -> str:
        return self.to_json()


def parse_speculative_config(value: "str | dict[str, Any] | SpeculativeConfig | None"
                             ) -> SpeculativeConfig | None:
    """The flag's parser: a JSON object (or a dict from the operator/Python); '', 'none' and
    None turn speculation off. Raises ValueError naming the key at fault."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if value.strip() in ("", "none", "None", "null"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 4}')
    values = dict(value)
    method, model = values.pop("method", None), values.get("model")
    if method in _NGRAM_SPELLINGS or (method is None and model in _NGRAM_SPELLINGS):
        method = "ngram"
        if model in _NGRAM_SPELLINGS:
            values.pop("model")
    elif method is None and model:
        method = "draft_model"
    if method is None:
        raise ValueError("--speculative-config needs 'method' (ngram, suffix or draft_model) "
                         "or a draft 'model'")
    if "num_speculative_tokens" not in values:
        raise ValueError("--speculative-config needs 'num_speculative_tokens'")
    known = {f.name for f in fields(SpeculativeConfig)} - {"method"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: "
                         f"method, {', '.join(sorted(known))}")
    return SpeculativeConfig(method=method, **values)
