"""The router's OpenTelemetry spans (`kubeinfer route --otlp-traces-endpoint`): one `route`
span per request under the client's `traceparent`, a `pick` child per attempt (it includes
waiting for a Ready engine when the service is at zero, and is marked as a retry after a pod
refused), and the forwarded `traceparent` names the `route` span, so the engine's
`llm_request` nests under it: client -> router -> engine in one trace."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Mapping

from ..api.error_body import OpenAIError
from ..otel import client_context, make_tracer, traceparent_of

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class RouterTracing:
    def __init__(self, endpoint: str, sampling_ratio: float = 1.0) -> None:
        self.provider, self.tracer = make_tracer(endpoint, sampling_ratio, "kubeinfer-router")

    def start(self, path: str, headers: Mapping[str, str]) -> "Span":
        """The request's `route` span; a malformed traceparent is a 400."""
        from opentelemetry.trace import SpanKind

        try:
            context = client_context(headers)
        except ValueError as error:
            raise OpenAIError(400, str(error), param="traceparent", code="invalid_traceparent") from None
        return self.tracer.start_span("route", context, SpanKind.SERVER, {"http.route": "/" + path})

    @contextlib.contextmanager
    def pick(self, parent: "Span", attempt: int) -> Iterator[None]:
        from opentelemetry import trace

        with self.tracer.start_as_current_span("pick", trace.set_span_in_context(parent),
                                               attributes={"kubeinfer.retry": attempt > 0}):
            yield

    @staticmethod
    def forward_headers(span: "Span", headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`headers` with the traceparent replaced by the `route` span's."""
        kept = [(k, v) for k, v in headers if k.lower() not in ("traceparent", "tracestate")]
        return kept + list(traceparent_of(span).items())

    def shutdown(self) -> None:
        self.provider.shutdown()
