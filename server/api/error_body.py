"""OpenAI's error JSON: the body every failure leaves as, from the engine's server and the router.

A leaf (fastapi's response class only), so the router and the middleware can answer in this
format without importing the engine; `errors.py` maps the engine's exceptions onto it.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class OpenAIError(Exception):
    """An error the client should see as-is, e.g. `OpenAIError(404, "...", code="model_not_found")`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 error_type: str | None = None) -> None:
        """`error_type`: the body's `type` when not the status's usual one (OpenAI's 429s say
        "tokens" or "requests")."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.error_type = error_type


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None, error_type: str | None = None) -> dict[str, Any]:
    error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: OpenAIError) -> JSONResponse:
    body = error_body(error.status, error.message, error.param, error.code, error.error_type)
    return JSONResponse(body, status_code=error.status, headers=error.headers)
