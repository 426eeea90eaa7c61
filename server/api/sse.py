"""Server-sent events as OpenAI streams them: `data: {json}` frames ending with `data: [DONE]`.

Once headers are out the status cannot change, so an error mid-stream becomes an error
frame (vLLM's behaviour) and the stream still ends with [DONE] for clients that wait on it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from .errors import as_openai_error, error_body
from .streams import ClientDisconnected

DONE = "data: [DONE]\n\n"


def frame(event: BaseModel) -> str:
    """One `data:` frame; a chunk's `usage` is left out until the final usage chunk."""
    exclude = {"usage"} if getattr(event, "usage", True) is None else None
    return f"data: {event.model_dump_json(exclude=exclude)}\n\n"


async def _frames(events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield frame(event)
    except ClientDisconnected:
        return
    except Exception as exc:  # noqa: BLE001 - every failure ends the stream the same way
        error = as_openai_error(exc)
        yield f"data: {json.dumps(error_body(error.status, error.message, error.param, error.code))}\n\n"
    yield DONE


def sse_response(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    return StreamingResponse(_frames(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
