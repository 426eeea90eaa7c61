"""One streaming request against an OpenAI-compatible endpoint, timed as vLLM's bench does:
TTFT to the first content chunk, ITL between content chunks, tokens from the server's usage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token answers."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _content(event: dict[str, Any]) -> str:
    parts = []
    for choice in event.get("choices") or []:
        parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> RequestResult:
    start = time.perf_counter()
    ttft: float | None = None
    last = start
    itl: list[float] = []
    chunks, usage = 0, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestResult(False, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestResult(False, error=f"stream error: {event['error']}"[:300])
                usage = event.get("usage") or usage
                if _content(event):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}"[:300])
    e2e = time.perf_counter() - start
    if ttft is None:
        return RequestResult(False, e2e=e2e, error="no content in the response")
    output_tokens = int(usage["completion_tokens"]) if usage else chunks
    prompt_tokens = int(usage["prompt_tokens"]) if usage else 0
    return RequestResult(True, prompt_tokens, output_tokens, ttft, e2e, itl)
