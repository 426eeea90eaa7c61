"""POST /v1/embeddings (OpenAI's shape, vLLM's extras) for an engine serving `--task embed`.

Each input is one engine request (`engine/pooler.py`): admitted, validated and batched like
completion prompts, so embeddings share the step loop with nothing blocking it. `base64` is the
float32 little-endian bytes of each vector, what the official client asks for by default and
decodes with numpy.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .errors import OpenAIError
from .protocol import MAX_PROMPTS, RequestBody
from .responses import Usage
from .state import ServerState, new_request_id
from .streams import chain, submit


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None   # matryoshka models only (the engine checks)
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    priority: int = 0

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("'input' must not be empty")
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} inputs per request, got {len(value)}")
            if any(item == "" or item == [] for item in value):
                raise ValueError("'input' must not contain empty strings or empty token lists")
        return value

    @property
    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData] = Field(default_factory=list)
    usage: Usage


def _encode(output: RequestOutput, encoding_format: str) -> list[float] | str:
    if output.embedding is None:   # aborted: the engine stopped before pooling it
        raise OpenAIError(503, "the server shut down before this request finished; retry on another replica",
                          code="shutdown", headers={"Retry-After": "1"})
    if encoding_format == "base64":
        return base64.b64encode(output.embedding.numpy().astype("<f4", copy=False).tobytes()).decode()
    return output.embedding.tolist()


async def create_embedding(body: EmbeddingRequest, request: Request, state: ServerState) -> Response:
    if state.resolve_model(body.model) is not None:
        raise OpenAIError(400, "LoRA adapters are not supported for embeddings", param="model")
    state.check_task("embed", "Embeddings")
    engine = state.engine

    def make(request_id: str, prompt: str | list[int]) -> Any:
        return engine.make_pooling_request(request_id, prompt, body.dimensions, "input",
                                           body.add_special_tokens, body.priority)

    request_id, created = new_request_id("embd"), int(time.time())
    given = {"priority": body.priority} if "priority" in body.model_fields_set else {}   # for tenancy's bounds
    first, outputs = await submit(state, request, request_id, body.inputs, SamplingParams(**given),
                                  prompt_param="input", make=make)
    finals: dict[int, RequestOutput] = {}
    async for index, output in chain(first, outputs):
        finals[index] = output
    usage = Usage()
    data = []
    for index, output in sorted(finals.items()):
        usage.add_request(output)
        data.append(EmbeddingData(index=index, embedding=_encode(output, body.encoding_format)))
    response = EmbeddingResponse(id=request_id, created=created, model=state.model_name, data=data, usage=usage)
    return JSONResponse(response.model_dump(mode="json"))
