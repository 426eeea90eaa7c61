"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, vLLM's flag), off by default.

One `llm_request` span per engine request (vLLM's name and `gen_ai.*` attributes), a child of
the client's W3C `traceparent` when it sends one, with children for where the time went:
`admission` (reading, validating and tokenizing the request; a `grammar_compile` child when a
structured output's grammar compiled), `queue` (waiting to be scheduled), `prefill` (to the
first token; a `prefill_chunk` child per chunk when chunked prefill split the prompt) and
`decode` (to the last; with speculative decoding, its draft and accepted token counts). Their
durations add up to the parent's.

The spans are built from the request's own timestamps when it finishes, on the HTTP side:
the engine's step creates no span object and does no tracing work at all, traced or not.
Prompt and output text never enter a span. The OpenTelemetry SDK is imported only when
tracing is on (the `tracing` extra: opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..otel import client_context, make_tracer
from .error_body import OpenAIError

if TYPE_CHECKING:
    from opentelemetry.context import Context


class Tracing:
    def __init__(self, endpoint: str, sampling_ratio: float = 1.0, service_name: str = "kubeinfer") -> None:
        """`endpoint`: an OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces)."""
        self.provider, self.tracer = make_tracer(endpoint, sampling_ratio, service_name)

    def context(self, headers: Mapping[str, str]) -> "Context":
        """The client's trace context; a malformed `traceparent` is the client's 400."""
        try:
            return client_context(headers)
        except ValueError as error:
            raise OpenAIError(400, str(error), param="traceparent", code="invalid_traceparent") from None

    def finished(self, context: "Context", started: float, output: RequestOutput, *, model: str,
                 params: SamplingParams, tenant: str | None,
                 grammar: tuple[float, float] | None = None) -> None:
        """Emit the request's spans; `started` is when the request reached the app (time.monotonic());
        `grammar`: when its structured output's grammar compiled (during admission)."""
        from opentelemetry.trace import SpanKind

        m = output.metrics
        end = m.finished_time or time.monotonic()
        offset = time.time_ns() - int(time.monotonic() * 1e9)   # monotonic -> epoch ns

        def ns(stamp: float) -> int:
            return int(stamp * 1e9) + offset

        arrival = m.arrival_time or started
        scheduled = m.first_scheduled_time or end
        first_token = m.first_token_time or end
        attributes: dict[str, Any] = {
            "gen_ai.request.id": output.request_id, "gen_ai.response.model": model,
            "gen_ai.request.max_tokens": params.max_tokens or 0, "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
            "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in output.outputs),
            "gen_ai.usage.cached_tokens": output.num_cached_tokens,
            "gen_ai.latency.time_in_queue": scheduled - arrival,
            "gen_ai.latency.time_to_first_token": first_token - arrival,
            "gen_ai.latency.e2e": end - arrival,
            "gen_ai.request.priority": params.priority,
        }
        if tenant:
            attributes["kubeinfer.tenant"] = tenant
        decode_attributes: dict[str, Any] = {}
        if m.draft_tokens:
            decode_attributes = {"kubeinfer.speculative.draft_tokens": m.draft_tokens,
                                 "kubeinfer.speculative.accepted_tokens": m.accepted_draft_tokens}
        spec = params.structured_outputs
        if spec is not None:   # which constraint, never its text (a schema may name private fields)
            attributes["kubeinfer.structured_output"] = next(
                (name for name in ("json", "regex", "choice", "grammar") if getattr(spec, name) is not None),
                "json_object")
        span = self.tracer.start_span("llm_request", context, SpanKind.SERVER, attributes, start_time=ns(started))
        from opentelemetry import trace

        inner = trace.set_span_in_context(span)
        parts = {}
        for name, begin, finish in (("admission", started, arrival), ("queue", arrival, scheduled),
                                    ("prefill", scheduled, first_token), ("decode", first_token, end)):
            parts[name] = self.tracer.start_span(name, inner, start_time=ns(begin),
                                                 attributes=decode_attributes if name == "decode" else None)
            parts[name].end(end_time=ns(max(begin, finish)))
        if grammar is not None:
            begin, finish = grammar
            self.tracer.start_span("grammar_compile", trace.set_span_in_context(parts["admission"]),
                                   start_time=ns(begin)).end(end_time=ns(max(begin, finish)))
        chunks = m.prefill_chunks
        if len(chunks) > 1:   # one chunk is the prefill span itself
            within = trace.set_span_in_context(parts["prefill"])
            for index, (begin, tokens) in enumerate(chunks):
                begin = scheduled if index == 0 else begin   # the first starts the prefill span
                finish = chunks[index + 1][0] if index + 1 < len(chunks) else first_token
                self.tracer.start_span("prefill_chunk", within, start_time=ns(begin), attributes={
                    "kubeinfer.prefill.chunk": index, "kubeinfer.prefill.tokens": tokens,
                }).end(end_time=ns(max(begin, finish)))
        span.end(end_time=ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()   # flushes what is batched
