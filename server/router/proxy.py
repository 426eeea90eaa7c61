"""The gateway's HTTP face: OpenAI requests in, forwarded (streams included) to an engine pod.

Only the OpenAI surface is forwarded (`FORWARDED`); any other path is answered 404 here, so the
engines' admin routes and anything added to them later stay off the Service. A body over the
engines' limit (`--max-request-body-bytes`) gets their 413 here as it streams in. A body the
picker reads (a completion's prompt, for its routing key) is read once, bounded by that limit;
any other body streams through to the engine, held only up to 64 KiB. A held body is replayed,
so a pod that refuses the connection (it was just removed) or closes it unanswered is retried
on another before anything reached the client. Responses are passed through byte-for-byte as
they arrive, which keeps server-sent events flowing token by token. With `routing`, each
completion request gets a routing key (its prompt's block hashes) for the picker, and the
cached tokens the engine reports in `usage` are counted against the prediction.
"""
from __future__ import annotations

import json
import logging
import re
import time
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..api.auth import OPEN_PATHS, ApiKeyCheck
from ..api.error_body import OpenAIError, error_body, error_response
from ..api.middleware import BodyLimit, BodyTooLarge
from ..flags import LONG_CONTEXT_TOKENS, default_max_body_bytes
from .activator import Activator, NoReadyPod
from .queue import Ticket
from .routing import Routing
from .tenancy import RouterTenancy
from .tracing import RouterTracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ..tenancy import Identity
    from .routing_key import RoutingKey

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
# The pod closed the connection before answering: it went away, or a pooled keep-alive
# connection raced its idle close. Nothing reached the client yet, so another pod may serve it.
UNANSWERED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
USAGE_TAIL = 4096  # bytes of a response kept to read its usage (the last object of a stream)
# What clients may reach through the router: the OpenAI API and vLLM's public extras. Paths only
# the operator or the routers use (the engines' admin port) are never forwarded.
FORWARDED = {"POST": ("v1/completions", "v1/chat/completions", "v1/embeddings", "tokenize", "detokenize"),
             "GET": ("v1/models", "version", "health", "ready")}


def forwarded(method: str, path: str) -> bool:
    """`path` (no leading slash) is part of the surface clients may reach (`FORWARDED`)."""
    paths = FORWARDED.get(method, ())
    return path in paths or (method == "GET" and path.startswith("v1/models/") and len(path) > len("v1/models/"))


# A body up to this size is held, so a request whose pod closed the connection unanswered (a
# pooled keep-alive connection racing its idle close) can be sent again; a larger one streams.
REPLAY_BYTES = 64 * 1024


class StreamedBody:
    """A request body passed to the engine as it arrives, after its first `head` bytes; `started`
    once any of it was sent, after which the request cannot be replayed on another pod."""

    def __init__(self, head: bytes, rest: AsyncIterator[bytes]) -> None:
        self.head, self.rest, self.started = head, rest, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.started = True
        yield self.head
        async for chunk in self.rest:
            yield chunk


async def request_body(request: Request) -> bytes | StreamedBody:
    """The whole body when it is small (`REPLAY_BYTES`), else its start and the rest to stream."""
    chunks = request.stream()
    head = b""
    async for chunk in chunks:
        head += chunk
        if len(head) > REPLAY_BYTES:
            return StreamedBody(head, chunks)
    return head


def build_app(activator: Activator, name: str, retry_after: int = 10,
              http: httpx.AsyncClient | None = None, api_keys: list[str] | ApiKeyCheck | None = None,
              routing: Routing | None = None, tenancy: RouterTenancy | None = None,
              tracing: RouterTracing | None = None,
              max_body_bytes: int | None = None) -> FastAPI:
    """`name` is the InferenceService, for error messages. With `api_keys` (the engines' own, or
    the check that follows their key files),
    a request without a valid key gets the engines' 401 here, before it can hold or wake
    anything; the Authorization header is forwarded untouched and the engine checks it again.
    With `routing`, requests carry routing keys and the engines' views are polled meanwhile.
    With `tenancy`, the key check also names the tenant and its quotas apply here (429).
    With `tracing`, each request gets a `route` span the engine's spans nest under.
    `max_body_bytes`: the engines' limit (default: a 128k-token context's, 8 MiB)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if routing is not None:
            await routing.start(activator.backends)
        try:
            yield
        finally:
            if routing is not None:
                await routing.stop()

    app = FastAPI(title=f"kubeinfer gateway for {name}", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes or default_max_body_bytes(LONG_CONTEXT_TOKENS))
    client = http or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    counts = activator.metrics.requests
    check_key = api_keys if isinstance(api_keys, ApiKeyCheck) else ApiKeyCheck(api_keys or [])

    @app.exception_handler(OpenAIError)
    async def _refused(_: Request, error: OpenAIError) -> JSONResponse:
        counts.labels(str(error.status)).inc()
        return error_response(error)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, error: BodyTooLarge) -> JSONResponse:
        counts.labels("413").inc()
        return JSONResponse(error_body(413, error.detail), status_code=413)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(activator.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        if not forwarded(request.method, path):
            raise OpenAIError(404, f"{request.method} /{path} is not served here", code="not_found")
        identity = None
        if "/" + path not in OPEN_PATHS:
            if tenancy is not None:
                identity = tenancy.admit(request.headers)
            else:
                await check_key(request)
        span = tracing.start(path, request.headers) if tracing is not None else None
        try:
            response = await _forward(path, request, identity, span)
        except BaseException:
            if span is not None:
                span.end()
            raise
        if span is not None and not isinstance(response, StreamingResponse):
            span.end()   # a relayed answer ends its span when it has streamed through
        return response

    async def _forward(path: str, request: Request, identity: Identity | None, span: Span | None) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        if span is not None:
            headers = RouterTracing.forward_headers(span, headers)
        body: bytes | StreamedBody
        key = None
        spent: float | None = None
        if routing is not None and routing.reads_body(path):
            body = await request.body()
            started = time.perf_counter()
            key = routing.key(path, body, request.headers)
            spent = time.perf_counter() - started
        else:
            body = await request_body(request)
        ticket, settle = Ticket(), None
        if tenancy is not None and identity is not None:
            ticket = tenancy.ticket(identity, path, body)
            # its estimate is reserved now; the usage also corrects its tenant's fair share
            settle = tenancy.reservation(identity, ticket, lambda tokens: activator.settle(ticket, tokens))
        try:
            response = await _send(path, request, headers, body, key, spent, ticket, span, settle)
        except BaseException:
            if settle is not None:
                settle(None)
            raise
        if settle is not None and not isinstance(response, StreamingResponse):
            settle(None)   # no engine answered it
        return response

    async def _send(path: str, request: Request, headers: list[tuple[str, str]], body: bytes | StreamedBody,
                    key: RoutingKey | None, spent: float | None, ticket: Ticket, span: Span | None,
                    settle: Callable[[bytes | None], None] | None) -> Response:
        """Forward to a picked pod; a second one if the first refused the connection or did not answer."""
        refused: list[str] = []
        failure = None   # why the pod tried last did not answer: this attempt is a retry
        for attempt in range(2):  # a second pod if the first refused the connection or did not answer
            if failure is not None:
                activator.metrics.retries.labels(failure).inc()
            stack = AsyncExitStack()
            try:
                with tracing.pick(span, attempt) if tracing is not None and span is not None else nullcontext():
                    base = await stack.enter_async_context(activator.upstream(key, refused, spent, ticket))
                spent = None
                upstream = await client.send(client.build_request(
                    request.method, f"{base}/{path}", params=request.query_params,
                    headers=headers, content=body), stream=True)
            except NoReadyPod as error:
                await stack.aclose()
                counts.labels("503").inc()
                return JSONResponse(error_body(503, f"InferenceService {name}: {error}; retry later",
                                               code="no_ready_replica"),
                                    status_code=503, headers={"Retry-After": str(retry_after)})
            except CONNECT_FAILURES as error:
                await stack.aclose()
                refused.append(base)
                failure = "refused"
                activator.backends.forget()
                log.warning("engine pod refused the connection: %s", error)
                continue
            except UNANSWERED as error:
                await stack.aclose()
                refused.append(base)
                failure = "unanswered"
                log.warning("engine pod %s closed the connection without answering: %r", base, error)
                if isinstance(body, StreamedBody) and body.started:
                    break   # part of the body went to that pod: it cannot be sent again
                continue
            except BaseException:   # the client's body passed the limit, or the client left
                await stack.aclose()
                raise
            counts.labels(str(upstream.status_code)).inc()
            stack.push_async_callback(upstream.aclose)
            reply = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
            observe = activator.metrics.actual_cached.observe if key is not None else None
            if span is not None:
                stack.callback(span.end)
            return StreamingResponse(_relay(upstream, stack, observe, settle), status_code=upstream.status_code,
                                     headers=dict(reply))
        counts.labels("502").inc()
        return JSONResponse(error_body(502, "no engine pod could be reached"), status_code=502)

    return app


async def _relay(upstream: httpx.Response, stack: AsyncExitStack,
                 observe_cached: Callable[[float], None] | None = None,
                 on_usage: Callable[[bytes | None], None] | None = None) -> AsyncIterator[bytes]:
    """Pass the body through as it arrives; the pod stays counted in flight until the end.
    With `observe_cached`, the `cached_tokens` of the answer's usage (its last object) is
    reported once the whole body went through; `on_usage` gets that last part of the body, or
    None when the answer failed, was cut or was no 200 (called once, also when the client left)."""
    tail = b""
    complete = False
    keep_tail = observe_cached is not None or on_usage is not None
    try:
        try:
            async for chunk in upstream.aiter_raw():
                if keep_tail:
                    tail = (tail + chunk)[-USAGE_TAIL:]
                yield chunk
        except httpx.HTTPError as error:   # the pod went away mid-answer
            log.warning("engine pod failed mid-answer: %r", error)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                # a stream ends with an error event (vLLM's shape), not a silently cut body
                event = error_body(502, "the engine pod serving this stream went away; retry the request")
                yield b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"
            return
        plain = "content-encoding" not in upstream.headers
        found = CACHED_TOKENS.findall(tail) if plain and upstream.status_code == 200 else []
        if observe_cached is not None and found:
            observe_cached(int(found[-1]))
        complete = plain and upstream.status_code == 200
    finally:
        if on_usage is not None:
            on_usage(tail if complete else None)
        await stack.aclose()
