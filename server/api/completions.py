"""POST /v1/completions: text or token-id prompts (one or a list), streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import CompletionOutput, RequestOutput
from .logprobs import completion_logprobs
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionResponse, Usage
from .sampling import sampling_params
from .sse import sse_response
from .state import ServerState, new_request_id
from .streams import Indexed, chain, submit
from .structured import constrain


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each a text or token ids (the engine tokenizes and checks them)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _choice(body: CompletionRequest, prompt_index: int, choice: CompletionOutput, text: str,
            token_ids: list[int], offset: int) -> CompletionChoice:
    """`text` and `token_ids` are the part being sent (all of it, or a stream delta) and
    `offset` is where that text starts in the whole choice."""
    logprobs = None
    if body.logprobs is not None and choice.logprobs is not None:
        window = choice.logprobs[len(choice.logprobs) - len(token_ids):]
        logprobs = completion_logprobs(token_ids, window, offset)
    return CompletionChoice(index=prompt_index * body.n + choice.index, text=text, logprobs=logprobs,
                            finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    adapter = state.resolve_model(body.model)
    model_name = adapter or state.model_name
    state.check_task("generate", "Completions")
    prompts = _prompts(body)
    params = sampling_params(body, body.max_tokens, body.logprobs)
    await constrain(state.engine, body, params)
    request_id, created = new_request_id("cmpl"), int(time.time())
    first, outputs = await submit(state, request, request_id, prompts, params, adapter=adapter)
    if body.stream:
        return sse_response(_stream(body, model_name, request_id, created, first, outputs))
    finals: dict[int, RequestOutput] = {}
    async for index, output in chain(first, outputs):
        finals[index] = output
    usage, choices = Usage(), []
    for index, output in sorted(finals.items()):
        usage.add_request(output)
        choices += [_choice(body, index, c, c.text, c.token_ids, 0) for c in output.outputs]
    response = CompletionResponse(id=request_id, created=created, model=model_name,
                                  choices=sorted(choices, key=lambda c: c.index), usage=usage)
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(body: CompletionRequest, model_name: str, request_id: str, created: int,
                  first: Indexed, outputs: AsyncIterator[Indexed]) -> AsyncIterator[CompletionResponse]:
    usage = Usage()
    async for index, output in chain(first, outputs):
        for choice in output.outputs:
            if not choice.delta_token_ids and not choice.delta_text and choice.finish_reason is None:
                continue
            offset = len(choice.text) - len(choice.delta_text)
            yield CompletionResponse(id=request_id, created=created, model=model_name, choices=[
                _choice(body, index, choice, choice.delta_text, choice.delta_token_ids, offset)])
        if output.finished:
            usage.add_request(output)
    if body.stream_options and body.stream_options.include_usage:
        yield CompletionResponse(id=request_id, created=created, model=model_name, choices=[],
                                 usage=usage)
