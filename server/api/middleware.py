"""ASGI middleware that keeps one bad request from costing more than its own answer.

`BodyLimit` refuses a body over the limit while it streams in (413 in OpenAI's format), so a
10 MB upload is never buffered, parsed or tokenized. `ContainErrors` turns an unexpected
exception into a 500 in OpenAI's format and ends there: Starlette's own handler for
`Exception` re-raises after answering, and uvicorn then closes the connection, so the
client's next keep-alive request on it was reset.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .error_body import error_body

logger = logging.getLogger(__name__)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes the limit; FastAPI lets HTTPExceptions from
    body reading through, and the app's handler answers it in OpenAI's format."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes "
                              "(--max-request-body-bytes)")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int | Callable[[], int], at_least: int = 0) -> None:
        """`max_bytes`, or a function giving it (the default depends on the engine's context
        length), called once and only for a body bigger than `at_least`, its lower bound."""
        self.app, self.at_least = app, at_least
        self._max_bytes = max_bytes if callable(max_bytes) else (lambda: max_bytes)

    @functools.cached_property
    def max_bytes(self) -> int:
        return self._max_bytes()

    def _too_large(self, size: int) -> bool:
        return size > self.at_least and size > self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and self._too_large(int(declared)):
            error = BodyTooLarge(self.max_bytes)
            await JSONResponse(error_body(413, error.detail), status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if self._too_large(received):
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


class ContainErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:  # noqa: BLE001 - answered here, not re-raised (see module docstring)
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await JSONResponse(error_body(500, "internal server error"), status_code=500)(
                    scope, receive, send)


class RequestClock:
    """Stamps `request.state.received` (time.monotonic()) as a request enters the app, before
    its body is read and validated: where a trace's `llm_request` span starts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["received"] = time.monotonic()
        await self.app(scope, receive, send)
