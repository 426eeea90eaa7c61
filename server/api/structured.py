"""Structured-output fields of a request -> the engine's `StructuredOutputsParams`.

Three spellings reach the same engine feature, as in vLLM: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs: {json|regex|choice|grammar}`, and
the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A request names
at most one constraint. The grammar compiles on a worker thread before the request is admitted,
so the engine step never waits for a compile and a bad schema is the client's 400.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..engine.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from .errors import OpenAIError
from .protocol import SamplingRequest

if TYPE_CHECKING:
    from ..engine.async_engine import AsyncEngine

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# (start, end) of this request's grammar compile, in time.monotonic(): each request is its own task
GRAMMAR_COMPILED: ContextVar[tuple[float, float] | None] = ContextVar("grammar_compiled", default=None)
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs(request: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a request asks for and the field it came from (None: free text)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif response_format.type == "json_schema":
            spec = response_format.json_schema
            if spec is None or spec.json_schema is None:
                raise OpenAIError(400, "response_format.json_schema.schema is required for type 'json_schema'",
                                  param="response_format.json_schema")
            found.append((StructuredOutputsParams(json=spec.json_schema), "response_format"))
        else:
            raise OpenAIError(400, f"response_format type {response_format.type!r} is not supported; use "
                              "'text', 'json_object' or 'json_schema'", param="response_format.type")
    if request.structured_outputs is not None:
        given = {key: value for key, value in request.structured_outputs.items()
                 if value is not None and value is not False}
        unknown = sorted(set(given) - set(_KINDS))
        if unknown:
            raise OpenAIError(400, f"structured_outputs.{unknown[0]} is not supported; use one of "
                              + ", ".join(_KINDS), param=f"structured_outputs.{unknown[0]}")
        if len(given) != 1:
            raise OpenAIError(400, "structured_outputs takes exactly one of " + ", ".join(_KINDS),
                              param="structured_outputs")
        found.append((_params(given, "structured_outputs"), "structured_outputs"))
    for name, kind in _LEGACY.items():
        value = getattr(request, name)
        if value is not None:
            found.append((_params({kind: value}, name), name))
    if len(found) > 1:
        raise OpenAIError(400, "give at most one structured-output constraint; this request has "
                          + " and ".join(field for _, field in found), param=found[1][1])
    return found[0] if found else None


def _params(given: dict[str, Any], field: str) -> StructuredOutputsParams:
    kind, value = next(iter(given.items()))
    expected = {"json": (dict, str), "regex": str, "grammar": str, "choice": list, "json_object": bool}[kind]
    if not isinstance(value, expected):
        raise OpenAIError(400, f"{field}: '{kind}' has the wrong type ({type(value).__name__})", param=field)
    try:
        params = StructuredOutputsParams(**{kind: value})
        params.validate()
    except InvalidRequestError as error:
        raise OpenAIError(400, f"{field}: {error}", param=field) from error
    return params


async def compile_ahead(engine: "AsyncEngine", spec: StructuredOutputsParams, field: str) -> None:
    """Compile (and cache) the grammar on a worker thread, so that making the engine request
    finds it compiled; a schema, regex or grammar xgrammar refuses is a 400 naming `field`.
    When it took (for the request's `grammar_compile` span) is left in `GRAMMAR_COMPILED`."""
    started = time.monotonic()
    try:
        await asyncio.to_thread(engine.compile_grammar, spec)
    except InvalidRequestError as error:
        raise OpenAIError(400, str(error), param=field) from error
    GRAMMAR_COMPILED.set((started, time.monotonic()))


async def constrain(engine: "AsyncEngine", request: SamplingRequest, params: SamplingParams) -> None:
    """Set `params.structured_outputs` from the request's fields, compiled ahead."""
    found = structured_outputs(request)
    if found is not None:
        spec, field = found
        await compile_ahead(engine, spec, field)
        params.structured_outputs = spec
