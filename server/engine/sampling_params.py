"""Per-request sampling knobs (vLLM's names and defaults): the one home of their domains.

`validate` refuses what has no meaning and normalises what the sampler could not compute
exactly in float32 (a tiny temperature, an extreme penalty), so every value that passes
reaches the sampler in a range where it yields finite logits and an in-vocabulary token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# vLLM's constants: below _SAMPLING_EPS a temperature means greedy; up to _MIN_TEMPERATURE
# it is raised to _MIN_TEMPERATURE (logits / 1e-40 overflow float32 to inf, softmax to NaN).
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
# A repetition penalty divides or multiplies logits: beyond these bounds the float32 result
# overflows (or a zero logit times inf is NaN) while the choice it makes stops changing.
PENALTY_RANGE = (1e-20, 1e20)
SEED_RANGE = (-2**63, 2**63 - 1)  # torch.Generator seeds are 64-bit, as vLLM bounds them
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message is meant for the client, `param` names the
    offending field and `code` is OpenAI's error code where one applies."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: exactly one constraint the output must match, enforced
    token by token with a grammar (server/engine/structured_output.py)."""

    json: str | dict[str, Any] | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # an EBNF (GBNF) grammar whose start rule is `root`
    json_object: bool = False  # any JSON object (OpenAI's JSON mode)

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of 'json', 'regex', 'choice', 'grammar' or "
                f"'json_object', got {', '.join(map(repr, given)) or 'none'}.")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured outputs 'choice' must be a non-empty list of strings.")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per token; the sampled token is always included
    # top-k alternatives per prompt position, with the prompt token itself (`prompt_logprobs.py`)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower is served first
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    # NOTE: the model's generation_config defaults apply only to fields the caller did not
    # set, so the constructor records which ones it was given (setting a field later counts too).
    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def __setattr__(self, name: str, value: Any) -> None:
        explicit = self.__dict__.get("_explicit")
        if explicit is not None:
            explicit.add(name)
        object.__setattr__(self, name, value)

    @property
    def explicit_fields(self) -> frozenset[str]:
        return frozenset(self.__dict__.get("_explicit", ()))

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy where every field the caller left unset takes the model's default."""
        names = {f.name for f in dataclasses.fields(self)}
        changes = {k: v for k, v in defaults.items()
                   if k in names and k not in self.explicit_fields and v is not None}
        merged = dataclasses.replace(self, **changes)
        object.__setattr__(merged, "_explicit", set(self.explicit_fields) | set(changes))
        return merged

    def validate(self) -> None:
        """Model-independent checks and normalisation; the engine adds context and vocabulary
        checks (`validation.py`)."""
        def fail(param: str, message: str) -> None:
            raise InvalidRequestError(message, param=param)

        def finite(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(name, f"{name} must be a finite number, got {value}.")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            finite(name)
        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            fail("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            fail("top_k", f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            fail("repetition_penalty",
                 f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            fail("seed", f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            fail("min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"min_tokens ({self.min_tokens}) must be less than or equal to "
                 f"max_tokens ({self.max_tokens}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                fail(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "stop strings must be non-empty strings.")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
            if self.ignore_eos:
                fail("ignore_eos", "ignore_eos cannot be combined with structured outputs: the grammar decides "
                     "where the output ends.")
        self._normalise()

    def _normalise(self) -> None:
        """Map values the sampler cannot compute exactly onto ones with the same effect."""
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.repetition_penalty = min(max(self.repetition_penalty, PENALTY_RANGE[0]), PENALTY_RANGE[1])


def _wrap_init(init: Any) -> Any:
    def __init__(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        given = [f.name for f in dataclasses.fields(SamplingParams)][:len(args)] + list(kwargs)
        object.__setattr__(self, "_explicit", set(given))

    __init__.__doc__ = init.__doc__
    return __init__


SamplingParams.__init__ = _wrap_init(SamplingParams.__init__)  # type: ignore[method-assign]
