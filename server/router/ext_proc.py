"""The router as a Gateway API Inference Extension endpoint picker (EPP): Envoy's ext_proc.

A gateway (Envoy Gateway, kgateway, Istio, or a plain Envoy) asks over gRPC which engine serves
each request; the answer follows GIE's endpoint-picker protocol (docs/proposals/004):

- the picked endpoint, then fallbacks in order, as `ip:port,ip:port` in the request header
  `x-gateway-destination-endpoint` and in dynamic metadata `envoy.lb` (the same value in both);
- only endpoints of the gateway's subset hint (`envoy.lb.subset_hint` filter metadata,
  `x-gateway-destination-endpoint-subset`) when it sends one;
- an immediate 503 when no endpoint is ready (or none of the subset), 429 when every endpoint's
  queue is at `--shed-queue-depth`;
- gRPC health for `liveness`, `readiness` and the ext_proc service.

The choice is the HTTP router's (`Activator` and its `Picker`: prefix-aware, least-load, LoRA
affinity), counted in flight until the gateway ends the stream. Bodies go by Envoy's modes:
FULL_DUPLEX_STREAMED (GIE's): the request body is held until complete (it holds the prompt; at most
`max_body_bytes`), then the headers answer and the body go back; response chunks are echoed at once.
BUFFERED: headers pass at once and the body answer carries the destination. Requests whose body
is not JSON, names a model no engine serves or is too large get an OpenAI error as an immediate
response; a stream that breaks the protocol ends with INVALID_ARGUMENT. Neither touches others.

With tenants (`--tenants-file` / `--trust-tenant-header`) the picker applies the HTTP router's
`RouterTenancy` to the headers Envoy forwards: the key and the tenant on the request headers
(401, 400), the priority and the token estimate on the body (400), the quotas (429 with
Retry-After and the limit's headers), all as immediate responses in OpenAI's error JSON. The
estimate is reserved when the request is routed and settled with the `usage` in the answer's
body as it streams back; an answer without usage, not a 200, or a stream that ends early gives
it back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import AsyncIterator, Callable, Sequence
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..api.auth import OPEN_PATHS
from ..api.error_body import OpenAIError, error_body
from ..tenancy import Identity
from .activator import Activator
from .routing import Routing
from .routing_key import RoutingKey
from .tenancy import RouterTenancy

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
BODY_CHUNK = 62_000   # streamed body answers stay under Envoy's 64 KiB gRPC message default
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
USAGE_TAIL = 4096
_Mode = processing_mode_pb2.ProcessingMode


class ProtocolError(Exception):
    """The gateway sent what the ext_proc protocol does not allow here."""


def host_port(url: str) -> str:
    """`http://10.0.0.7:8000` -> `10.0.0.7:8000` (the protocol's endpoint form)."""
    parts = urlsplit(url)
    return parts.netloc or url


def immediate(error: OpenAIError) -> pb.ProcessingResponse:
    """The error as Envoy's immediate answer: its status, OpenAI's body and its headers."""
    body = error_body(error.status, error.message, error.param, error.code, error.error_type)
    headers = [("content-type", "application/json"), *((k.lower(), v) for k, v in error.headers.items())]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status), body=json.dumps(body).encode(),
        headers=_mutation(headers), details=f"kubeinfer-epp: {error.code}"))


def _mutation(headers: Sequence[tuple[str, str]]) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in headers])


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def _subset(request: pb.ProcessingRequest) -> set[str] | None:
    """The gateway's subset hint, when it sent one (an empty list: nothing is eligible)."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    items = value.list_value.values if value.HasField("list_value") else [value]
    endpoints: set[str] = set()
    for item in items:
        endpoints.update(e.strip() for e in item.string_value.split(",") if e.strip())
    return endpoints


class PickerSettings:
    """What the ext_proc mode adds to the HTTP router's settings."""

    def __init__(self, fallbacks: int = 2, shed_queue_depth: int = 0, max_body_bytes: int = 16 << 20,
                 retry_after: int = 10) -> None:
        self.fallbacks, self.shed_queue_depth = fallbacks, shed_queue_depth
        self.max_body_bytes, self.retry_after = max_body_bytes, retry_after


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, activator: Activator, routing: Routing | None, settings: PickerSettings = PickerSettings(),
                 tenancy: RouterTenancy | None = None) -> None:
        """`tenancy`: the HTTP router's tenants and quotas (the same object when both faces run)."""
        self.activator, self.routing, self.settings, self.tenancy = activator, routing, settings, tenancy

    def _retry_later(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after)}

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self)
        try:
            async for message in request_iterator:
                for response in await exchange.on(message):
                    yield response
                if exchange.finished:
                    return
        except ProtocolError as error:
            log.warning("ext_proc stream refused: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kubeinfer-epp: {error}")
        finally:
            exchange.release()

    # -- the pick ---------------------------------------------------------------------------

    async def candidates(self, subset: set[str] | None) -> list[str]:
        urls = await self.activator.backends.ready()
        if subset is not None:
            urls = [url for url in urls if host_port(url) in subset]
        if not urls:
            raise OpenAIError(503, "no ready endpoint in the pool" + (" subset" if subset is not None else ""),
                              code="no_ready_endpoint", headers=self._retry_later())
        return urls

    def check_model(self, model: object) -> None:
        views = self.routing.views if self.routing is not None else None
        known = views.models() if views is not None else frozenset()
        if isinstance(model, str) and known and model not in known:
            raise OpenAIError(404, f"The model `{model}` does not exist.", code="model_not_found")

    def shed(self, urls: Sequence[str]) -> None:
        depth = self.settings.shed_queue_depth
        views = self.routing.views if self.routing is not None else None
        if depth <= 0 or views is None:
            return
        if all(views.get(url).waiting >= depth for url in urls):
            raise OpenAIError(429, f"every endpoint has {depth} or more requests waiting; retry later",
                              code="overloaded", headers=self._retry_later())

    def fallbacks(self, urls: Sequence[str], primary: str) -> list[str]:
        """The other endpoints, least loaded first (no side effects on the picker's state)."""
        in_flight = self.activator.in_flight
        views = self.routing.views if self.routing is not None else None
        rest = [url for url in urls if url != primary]
        rest.sort(key=lambda u: views.load(u, in_flight.get(u, 0)) if views else in_flight.get(u, 0))
        return rest[:self.settings.fallbacks]


class _Exchange:
    """One HTTP request's ext_proc stream."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.request_mode = _Mode.FULL_DUPLEX_STREAMED
        self.response_mode = _Mode.FULL_DUPLEX_STREAMED
        self.headers: dict[str, str] | None = None
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.held: tuple[str, RoutingKey | None] | None = None   # (url, key) counted in flight
        self.identity: Identity | None = None   # with tenants: who sends it
        self.settle: Callable[[bytes | None], None] | None = None   # its reserved tokens, to settle
        self.answered = False   # a 200 whose body the picker can read (not compressed)
        self.finished = False
        self.tail = b""
        self.started = time.perf_counter()

    async def on(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode or self.request_mode
            self.response_mode = message.protocol_config.response_body_mode or self.response_mode
        if kind is None:
            raise ProtocolError("a ProcessingRequest with no request, headers or body set")
        if kind != "request_headers" and self.headers is None:
            raise ProtocolError(f"{kind} before request_headers")
        try:
            return await getattr(self, "_" + kind)(message)
        except OpenAIError as refusal:
            self.finished = True
            self.picker.activator.metrics.requests.labels(str(refusal.status)).inc()
            return [immediate(refusal)]

    async def _request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.headers is not None:
            raise ProtocolError("request_headers twice in one stream")
        self.headers = _headers(message.request_headers)
        self.subset = _subset(message)
        tenancy = self.picker.tenancy
        if tenancy is not None and self._path() not in OPEN_PATHS:
            self.identity = tenancy.admit(self.headers)
        if message.request_headers.end_of_stream or self.request_mode == _Mode.NONE:
            return [await self._routed_headers(None)]
        if self.request_mode in (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL, _Mode.STREAMED):
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []   # FULL_DUPLEX_STREAMED: the headers answer waits for the body (it holds the prompt)

    async def _request_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = message.request_body
        if self.held is not None:
            raise ProtocolError("request_body after the request body ended")
        self.body += chunk.body
        if len(self.body) > self.picker.settings.max_body_bytes:
            raise OpenAIError(413, f"request body over {self.picker.settings.max_body_bytes} bytes",
                              code="request_too_large")
        if self.request_mode == _Mode.STREAMED:   # each chunk passes; the pick is made on headers only
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        if not chunk.end_of_stream:
            return []
        return await self._complete()

    async def _request_trailers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        answers = [] if self.held is not None else await self._complete()
        return answers + [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]

    async def _complete(self) -> list[pb.ProcessingResponse]:
        """The whole request body is here: parse it, pick, and let the request go."""
        assert self.headers is not None
        path = self._path()
        key = None
        if self.headers.get(":method", "POST") == "POST" and self.body:
            try:
                parsed = json.loads(self.body)
            except ValueError:
                raise OpenAIError(400, "the request body is not JSON", code="invalid_request_error") from None
            if not isinstance(parsed, dict):
                raise OpenAIError(400, "the request body must be a JSON object", code="invalid_request_error")
            self.picker.check_model(parsed.get("model"))
            routing = self.picker.routing
            if routing is not None:
                key = routing.key(path.lstrip("/"), bytes(self.body), self.headers)
        headers = await self._routed_headers(key)
        if self.request_mode in (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL):
            return [pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=pb.CommonResponse(
                    header_mutation=headers.request_headers.response.header_mutation, clear_route_cache=True)),
                dynamic_metadata=headers.dynamic_metadata)]
        body, self.body = bytes(self.body), bytearray()
        pieces = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
        return [headers] + [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=piece, end_of_stream=index == len(pieces) - 1)))))
            for index, piece in enumerate(pieces)]

    def _path(self) -> str:
        return (self.headers or {}).get(":path", "/").split("?", 1)[0]

    async def _routed_headers(self, key: RoutingKey | None) -> pb.ProcessingResponse:
        picker = self.picker
        ticket = None
        if picker.tenancy is not None and self.identity is not None:   # its priority: 400 before the pick
            ticket = picker.tenancy.ticket(self.identity, self._path(), bytes(self.body))
        urls = await picker.candidates(self.subset)
        picker.shed(urls)
        activator = picker.activator
        url = activator.pick(urls, key, time.perf_counter() - self.started)
        activator.hold(url)
        self.held = (url, key)
        if ticket is not None:
            self.settle = picker.tenancy.reservation(self.identity, ticket)
        endpoints = ",".join(host_port(u) for u in [url, *picker.fallbacks(urls, url)])
        headers = [(DESTINATION, endpoints)]
        if self.body and self.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            headers.append(("content-length", str(len(self.body))))   # Envoy drops it in this mode
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: endpoints}})
        log.debug("%s %s -> %s", self.headers.get(":method") if self.headers else "?",
                  self.headers.get(":path") if self.headers else "?", endpoints)
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=_mutation(headers), clear_route_cache=True)),
            dynamic_metadata=metadata)

    async def _response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        served = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
        headers = _headers(message.response_headers)
        status = headers.get(":status", "")
        self.answered = status == "200" and "content-encoding" not in headers
        if status:
            self.picker.activator.metrics.requests.labels(status).inc()
        if served is not None and SERVED in served.fields and self.held is not None:
            log.debug("served by %s (picked %s)", served.fields[SERVED].string_value, host_port(self.held[0]))
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    async def _response_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = message.response_body
        self.tail = (self.tail + chunk.body)[-USAGE_TAIL:]
        if chunk.end_of_stream:
            self._observe_usage()
            if self.settle is not None:
                self.settle(self.tail if self.answered else None)
        if self.response_mode == _Mode.FULL_DUPLEX_STREAMED:
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=chunk.body, end_of_stream=chunk.end_of_stream)))))]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    async def _response_trailers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]

    def _observe_usage(self) -> None:
        if self.held is not None and self.held[1] is not None:
            found = CACHED_TOKENS.findall(self.tail)
            if found:
                self.picker.activator.metrics.actual_cached.observe(int(found[-1]))

    def release(self) -> None:
        """The stream ended: a reservation not settled by the answer's usage is given back."""
        if self.settle is not None:
            self.settle(None)
        if self.held is not None:
            url, key = self.held
            self.held = None
            self.picker.activator.unhold(url, key)


async def start_server(picker: EndpointPicker, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """The ext_proc and health services on `host:port` (port 0: any free one); returns the bound port."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 32 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for service in HEALTH_SERVICES:
        await health_service.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def serve(picker: EndpointPicker, host: str, port: int, app: object | None, http_port: int,
                log_level: str, routing: Routing | None, metrics_port: int | None = None) -> None:
    """The ext_proc server, beside the HTTP router `app` (None: ext_proc only, which then runs the
    engines' polling itself, and serves the metrics on `metrics_port` when given), until SIGTERM
    or SIGINT."""
    import signal

    import uvicorn
    from prometheus_client import start_http_server

    server, bound = await start_server(picker, host, port)
    log.info("endpoint picker (ext_proc) on %s:%d", host, bound)
    metrics = None
    try:
        if app is not None:
            await uvicorn.Server(uvicorn.Config(app, host=host, port=http_port, log_level=log_level)).serve()
            return
        if metrics_port is not None:
            metrics, _ = start_http_server(metrics_port, host, registry=picker.activator.metrics.registry)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if routing is not None:
            await routing.start(picker.activator.backends)
        try:
            await stop.wait()
        finally:
            if routing is not None:
                await routing.stop()
    finally:
        if metrics is not None:
            metrics.shutdown()
        await server.stop(grace=5)
