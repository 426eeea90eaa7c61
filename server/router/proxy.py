"""The gateway's HTTP face: OpenAI requests in, forwarded (streams included) to an engine pod.

Bodies are read once and replayed, so a pod that refuses the connection (it was just removed)
is retried on another before anything reached the client. Responses are passed through
byte-for-byte as they arrive, which keeps server-sent events flowing token by token. With
`routing`, each completion request gets a routing key (its prompt's block hashes) for the
picker, and the cached tokens the engine reports in `usage` are counted against the prediction.
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
from .activator import Activator, NoReadyPod
from .routing import Routing
from .tenancy import RouterTenancy
from .tracing import RouterTracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ..tenancy import Identity

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
# The pod closed the connection before answering: it went away, or a pooled keep-alive
# connection raced its idle close. Nothing reached the client yet, so another pod may serve it.
UNANSWERED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
USAGE_TAIL = 4096  # bytes of a response kept to read its usage (the last object of a stream)


def build_app(activator: Activator, name: str, retry_after: int = 10,
              http: httpx.AsyncClient | None = None, api_keys: list[str] | None = None,
              routing: Routing | None = None, tenancy: RouterTenancy | None = None,
              tracing: RouterTracing | None = None) -> FastAPI:
    """`name` is the InferenceService, for error messages. With `api_keys` (the engines' own),
    a request without a valid key gets the engines' 401 here, before it can hold or wake
    anything; the Authorization header is forwarded untouched and the engine checks it again.
    With `routing`, requests carry routing keys and the engines' views are polled meanwhile.
    With `tenancy`, the key check also names the tenant and its quotas apply here (429).
    With `tracing`, each request gets a `route` span the engine's spans nest under."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if routing is not None:
            await routing.start(activator.backends)
        try:
            yield
        finally:
            if routing is not None:
                await routing.stop()

    app = FastAPI(title=f"kubeinfer gateway for {name}", docs_url=None, redoc_url=None, lifespan=lifespan)
    client = http or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    counts = activator.metrics.requests
    check_key = ApiKeyCheck(api_keys or [])

    @app.exception_handler(OpenAIError)
    async def _refused(_: Request, error: OpenAIError) -> JSONResponse:
        counts.labels(str(error.status)).inc()
        return error_response(error)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(activator.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        identity = None
        if "/" + path not in OPEN_PATHS:
            if tenancy is not None:
                identity = tenancy.admit(request)
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
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        if span is not None:
            headers = RouterTracing.forward_headers(span, headers)
        started = time.perf_counter()
        key = routing.key(path, body, request.headers) if routing is not None else None
        spent: float | None = time.perf_counter() - started
        refused: list[str] = []
        for attempt in range(2):  # a second pod if the first refused the connection or did not answer
            stack = AsyncExitStack()
            try:
                with tracing.pick(span, attempt) if tracing is not None and span is not None else nullcontext():
                    base = await stack.enter_async_context(activator.upstream(key, refused, spent))
                spent = None
                upstream = await client.send(client.build_request(
                    request.method, f"{base}/{path}", params=request.query_params,
                    headers=headers, content=body), stream=True)
            except NoReadyPod as error:
                await stack.aclose()
                counts.labels("503").inc()
                return JSONResponse(error_body(503, f"InferenceService {name} is scaled to "
                                                    f"zero and {error}; retry later",
                                               code="no_ready_replica"),
                                    status_code=503, headers={"Retry-After": str(retry_after)})
            except CONNECT_FAILURES as error:
                await stack.aclose()
                refused.append(base)
                activator.backends.forget()
                log.warning("engine pod refused the connection: %s", error)
                continue
            except UNANSWERED as error:
                await stack.aclose()
                refused.append(base)
                log.warning("engine pod %s closed the connection without answering: %r", base, error)
                continue
            counts.labels(str(upstream.status_code)).inc()
            stack.push_async_callback(upstream.aclose)
            reply = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
            observe = activator.metrics.actual_cached.observe if key is not None else None
            usage = None
            if tenancy is not None and identity is not None:
                usage = lambda tail, who=identity: tenancy.charge(who, tail)  # noqa: E731
            if span is not None:
                stack.callback(span.end)
            return StreamingResponse(_relay(upstream, stack, observe, usage), status_code=upstream.status_code,
                                     headers=dict(reply))
        counts.labels("502").inc()
        return JSONResponse(error_body(502, "no engine pod could be reached"), status_code=502)

    return app


async def _relay(upstream: httpx.Response, stack: AsyncExitStack,
                 observe_cached: Callable[[float], None] | None = None,
                 on_usage: Callable[[bytes], None] | None = None) -> AsyncIterator[bytes]:
    """Pass the body through as it arrives; the pod stays counted in flight until the end.
    With `observe_cached`, the `cached_tokens` of the answer's usage (its last object) is
    reported once the whole body went through; `on_usage` gets that last part of the body."""
    tail = b""
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
        if on_usage is not None and plain and upstream.status_code == 200:
            on_usage(tail)
    finally:
        await stack.aclose()
