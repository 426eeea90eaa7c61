"""Bearer API keys, checked in constant time; probes and /metrics stay open for the kubelet
and Prometheus, like vLLM which guards only the API routes."""

from __future__ import annotations

import hmac

from fastapi import Request

from kubeinfer.server.api.errors import OpenAIError


class ApiKeyCheck:
    """FastAPI dependency: refuses with 401 unless the request carries one of `keys`."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = [key.encode() for key in keys]

    async def __call__(self, request: Request) -> None:
        if not self.keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        given = token.strip().encode()
        # NOTE: compare against every key so the time taken does not reveal which one matched.
        matched = [hmac.compare_digest(given, key) for key in self.keys]
        if not any(matched):
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
