"""Every failure leaves the server as OpenAI's error JSON with the matching HTTP status.

Clients (the official SDKs, LangChain, vLLM's benchmark) branch on the status and on
`error.code`, so FastAPI's default 422 shape and bare 500 pages must never reach them.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import EngineDeadError, RequestFailedError
from ..engine.sampling_params import InvalidRequestError
from .error_body import OpenAIError, error_body, error_response  # noqa: F401 - this module's names too
from .middleware import ContainErrors

logger = logging.getLogger(__name__)

# pydantic names the member of a union that failed ('str', 'list[int]') in the error location
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|[\w-]+\[.*\])$")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as 'field: reason', without echoing the client's input back."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    cause = first.get("ctx", {}).get("error")
    if getattr(cause, "param", None):  # protocol.InvalidText: the path is known, the location is not
        return str(cause), cause.param
    parts = [str(part) for part in first.get("loc", ()) if part != "body"]
    reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if parts and _UNION_MEMBER.match(parts[-1]):
        parts = parts[:-1]
        reason = "value has none of the accepted types"
    field = ".".join(parts) or None
    return (f"{field}: {reason}" if field else reason), field


def as_openai_error(exc: Exception) -> OpenAIError:
    """The client-facing form of an exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):   # model_not_found: an adapter unloaded meanwhile
        return OpenAIError(404 if exc.code == "model_not_found" else 400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineDeadError):
        logger.error("request refused: %s", exc)  # /health and /ready fail; the process exits
        return OpenAIError(503, "the engine is not running; retry on another replica", code="engine_dead",
                           headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailedError):  # the engine logged the cause and goes on
        return OpenAIError(500, str(exc), code="request_failed")
    logger.error("unhandled error while serving a request", exc_info=exc)
    return OpenAIError(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for every error a route raises on purpose; anything else is answered by
    `middleware.ContainErrors` (a handler for `Exception` would make Starlette re-raise it
    after answering, and uvicorn close the keep-alive connection)."""
    app.add_middleware(ContainErrors)

    async def _mapped(_: Request, exc: Exception) -> JSONResponse:
        return error_response(as_openai_error(exc))

    for error_type in (OpenAIError, InvalidRequestError, EngineDeadError, RequestFailedError):
        app.add_exception_handler(error_type, _mapped)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(OpenAIError(exc.status_code, message, headers=exc.headers))
