"""`kubeinfer route` stays bounded under hostile bodies and forwards only the OpenAI surface.

A real router process in front of a real engine (tiny model). 20 clients each try to send a
100 MB body, half declaring it (Content-Length), half chunked (no length: the router must count
as it reads), to a path whose body the picker reads (/v1/completions) and to one it streams
(/v1/embeddings). Each gets 413 in OpenAI's error format, ordinary requests sent meanwhile are
served, and the router's peak RSS (VmHWM) stays far under its pod's 512 MiB limit.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from helpers.serve_process import free_port, start_kubeinfer

pytestmark = pytest.mark.integration

LIMIT = 4 << 20                  # the router's --max-request-body-bytes
HOSTILE_BYTES = 100_000_000      # what each hostile client tries to send
CHUNK = b"1," * (1 << 19)        # 1 MiB of a JSON list's insides
POD_LIMIT_MIB = 512              # the router Deployment's memory limit (operator/router_build.py)


def _rss_kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")))


async def _hostile(port: int, path: str, chunked: bool) -> tuple[int, dict, int]:
    """Send up to HOSTILE_BYTES until the router answers; (status, error body, bytes sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {HOSTILE_BYTES}"
    writer.write(f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                 f"{length}\r\n\r\n".encode())
    answer = asyncio.ensure_future(reader.read(1 << 16))
    sent = 0
    try:
        while sent < HOSTILE_BYTES and not answer.done():
            data = b'{"model": "m", "prompt": [' + CHUNK[26:] if sent == 0 else CHUNK
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if chunked else data)
            await writer.drain()
            sent += len(data)
            # drain() returns at once while the router keeps reading (uvicorn discards the rest of
            # a refused body): let the loop hand over an answer that has come meanwhile
            await asyncio.sleep(0)
    except ConnectionError:
        pass   # the router answered and closed while we were still sending
    raw = await asyncio.wait_for(answer, 60)
    while b"\r\n\r\n" not in raw or raw.endswith(b"\r\n\r\n"):   # the rest of the answer, to its close
        more = await asyncio.wait_for(reader.read(1 << 16), 60)
        if not more:
            break
        raw += more
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    if b"chunked" in head.lower():   # the error body itself may come chunked
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body or b"{}"), sent


@pytest.fixture(scope="module")
def router(tiny_model_path: str):
    with ExitStack() as stack:
        engine_port, router_port = free_port(), free_port()
        start_kubeinfer(["serve", "--model", tiny_model_path, "--dtype", "float32", "--device", "cpu",
                         "--kv-cache-memory", "8Mi", "--max-model-len", "128"], engine_port, stack)
        process = start_kubeinfer(["route", "--backend", f"http://127.0.0.1:{engine_port}",
                                   "--max-request-body-bytes", str(LIMIT)], router_port, stack)
        yield router_port, process.pid


def test_hostile_bodies_get_413_while_the_router_stays_small_and_serves(router) -> None:
    port, pid = router

    async def run() -> tuple[list, list[int]]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            warm = await client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2})
            assert warm.status_code == 200, warm.text
            hostile = [_hostile(port, path, chunked) for chunked in (False, True)
                       for path in ("/v1/completions", "/v1/embeddings") for _ in range(5)]

            async def normal() -> int:
                response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                return response.status_code

            results = await asyncio.gather(*hostile, *(normal() for _ in range(6)))
        return results[:20], results[20:]

    before = _rss_kib(pid, "VmRSS")
    hostile, normal = asyncio.run(run())
    peak = _rss_kib(pid, "VmHWM")
    print(f"router RSS before {before / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB; bytes sent per "
          f"hostile client: {sorted(sent for _, _, sent in hostile)}")
    assert [status for status, _, _ in hostile] == [413] * 20
    for _, body, sent in hostile:
        assert body.get("error", {}).get("type") == "invalid_request_error" and str(LIMIT) in body["error"]["message"], body
        assert sent < HOSTILE_BYTES   # refused while it streamed in, not after 100 MB
    assert normal == [200] * 6
    assert peak < POD_LIMIT_MIB * 1024 and peak - before < 20 * LIMIT // 1024


def test_only_the_openai_surface_is_forwarded(router) -> None:
    port, _ = router
    url = f"http://127.0.0.1:{port}"
    for method, path in (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                         ("GET", "/kv/blocks"), ("GET", "/tokenizer_info"), ("GET", "/metrics/../kv/blocks"),
                         ("DELETE", "/v1/models"), ("GET", "/openapi.json")):
        response = httpx.request(method, url + path, json={"lora_name": "x", "lora_path": "/"})
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    assert httpx.get(url + "/v1/models").json()["data"][0]["object"] == "model"
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).json()["count"] > 0
