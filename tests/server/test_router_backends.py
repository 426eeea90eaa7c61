"""`kubeinfer route --backend URL`: which of the given engines are ready. kubeinfer engines answer
`/ready`; engines without it (vLLM, SGLang: 404) count as ready when their `/health` answers 200."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kubeinfer.server.router.backends import StaticBackends

pytestmark = pytest.mark.unit

ANSWERS = {  # engine -> path -> status
    "http://kubeinfer-ready": {"/ready": 200},
    "http://kubeinfer-warming": {"/ready": 503, "/health": 200},
    "http://vllm-serving": {"/health": 200},
    "http://vllm-starting": {"/health": 503},
}


def _engine(request: httpx.Request) -> httpx.Response:
    status = ANSWERS[f"http://{request.url.host}"].get(request.url.path, 404)
    return httpx.Response(status, json={})


def test_ready_by_ready_or_else_by_health() -> None:
    async def ready() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_engine)) as client:
            return await StaticBackends(list(ANSWERS), client).ready()

    assert asyncio.run(ready()) == ["http://kubeinfer-ready", "http://vllm-serving"]
