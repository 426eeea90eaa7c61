"""OpenTelemetry plumbing shared by the engine's server and the router (a leaf: the SDK is
imported only when a tracer is made, i.e. only with tracing on)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

# W3C Trace Context: version-traceid-parentid-flags, lowercase hex, ids not all zeros
TRACEPARENT = re.compile(r"^[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
TRACEPARENT_HELP = ("traceparent: not a W3C Trace Context header (version-traceid-parentid-flags in "
                    "lowercase hex, e.g. 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01)")

# xds-protos (the router's ext_proc stubs) ships an old copy of opentelemetry/proto/*, and the
# wheel pip installs last owns those files.
STALE_OTLP_PROTOS_HELP = ("another package (xds-protos) overwrote opentelemetry-proto's modules with an "
                          "older copy; `pip install --force-reinstall --no-deps opentelemetry-proto` "
                          "puts them back")


def make_tracer(endpoint: str, sampling_ratio: float, service_name: str) -> tuple["TracerProvider", "Tracer"]:
    """A provider exporting to an OTLP/HTTP traces `endpoint` in batches, sampling new traces at
    `sampling_ratio` and following a sampled parent."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        if "opentelemetry.proto" not in str(error):
            raise
        raise ImportError(f"{error}: {STALE_OTLP_PROTOS_HELP}") from error
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if not 0.0 <= sampling_ratio <= 1.0:
        raise ValueError(f"--otlp-traces-sampling-ratio must be in [0, 1], got {sampling_ratio}")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBased(TraceIdRatioBased(sampling_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider, provider.get_tracer(f"kubeinfer.{service_name}")


def client_context(headers: Mapping[str, str]) -> "Context":
    """The trace context the client sent; ValueError(TRACEPARENT_HELP) when it is malformed."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    traceparent = headers.get("traceparent")
    if traceparent is not None and not TRACEPARENT.match(traceparent.strip()):
        raise ValueError(TRACEPARENT_HELP)
    carrier = {"traceparent": traceparent.strip()} if traceparent else {}
    return TraceContextTextMapPropagator().extract(carrier)


def traceparent_of(span: "Span") -> dict[str, Any]:
    """The `traceparent` header that makes the next hop a child of `span`."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, Any] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier
