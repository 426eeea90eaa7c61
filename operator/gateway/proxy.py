"""The gateway's HTTP face: OpenAI requests in, forwarded (streams included) to an engine pod.

Bodies are read once and replayed, so a pod that refuses the connection (it was just removed)
is retried on another before anything reached the client. Responses are passed through
byte-for-byte as they arrive, which keeps server-sent events flowing token by token.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubeinfer.operator.gateway.activator import Activator, NoReadyPod
from kubeinfer.server.api.auth import OPEN_PATHS, ApiKeyCheck
from kubeinfer.server.api.errors import OpenAIError, error_body, error_response

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)


def build_app(activator: Activator, name: str, retry_after: int = 10,
              http: httpx.AsyncClient | None = None, api_keys: list[str] | None = None) -> FastAPI:
    """`name` is the InferenceService, for error messages. With `api_keys` (the engines' own),
    a request without a valid key gets the engines' 401 here, before it can hold or wake
    anything; the Authorization header is forwarded untouched and the engine checks it again."""
    app = FastAPI(title=f"kubeinfer gateway for {name}", docs_url=None, redoc_url=None)
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
        if "/" + path not in OPEN_PATHS:
            await check_key(request)
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        for _ in range(2):  # a second pod if the first refused the connection
            stack = AsyncExitStack()
            try:
                base = await stack.enter_async_context(activator.upstream())
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
                activator.backends.forget()
                log.warning("engine pod refused the connection: %s", error)
                continue
            counts.labels(str(upstream.status_code)).inc()
            stack.push_async_callback(upstream.aclose)
            reply = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
            return StreamingResponse(_relay(upstream, stack), status_code=upstream.status_code,
                                     headers=dict(reply))
        counts.labels("502").inc()
        return JSONResponse(error_body(502, "no engine pod could be reached"), status_code=502)

    return app


async def _relay(upstream: httpx.Response, stack: AsyncExitStack) -> AsyncIterator[bytes]:
    """Pass the body through as it arrives; the pod stays counted in flight until the end."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await stack.aclose()
