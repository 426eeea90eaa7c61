"""POST /v1/chat/completions: messages rendered with the model's own chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kubeinfer.server.api.errors import OpenAIError
from kubeinfer.server.api.logprobs import chat_logprobs
from kubeinfer.server.api.protocol import ChatCompletionRequest, ChatMessage
from kubeinfer.server.api.responses import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                            ChatCompletionChunk, ChatCompletionResponse, DeltaMessage, Usage)
from kubeinfer.server.api.sampling import sampling_params
from kubeinfer.server.api.sse import sse_response
from kubeinfer.server.api.state import ServerState, new_request_id
from kubeinfer.server.api.streams import Indexed, chain, submit
from kubeinfer.server.engine.outputs import CompletionOutput, RequestOutput


def render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text (`Tokenizer.chat_prompt`, which the router repeats); it already holds any
    BOS, so none is added when tokenizing.

    `template_kwargs` are extra template variables (vLLM's `chat_template_kwargs`): there,
    `add_generation_prompt` and `continue_final_message` override the request's fields as in
    vLLM, while `messages` is the server's own and refused. Any failure of the template on
    this input is the client's 400, never a 500.
    """
    if "messages" in (template_kwargs or {}):
        raise OpenAIError(400, "chat_template_kwargs.messages: the template's messages come from the "
                          "request's 'messages' field", param="chat_template_kwargs.messages")
    try:
        return state.engine.tokenizer.chat_prompt([message.to_template() for message in messages],
                                                  add_generation_prompt, continue_final_message, template_kwargs)
    except Exception as exc:  # noqa: BLE001 - ChatTemplateError, or a template tripping on odd kwargs
        raise OpenAIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc


def _logprobs(body: ChatCompletionRequest, choice: CompletionOutput, token_ids: list[int]):
    if not body.logprobs or choice.logprobs is None:
        return None
    window = choice.logprobs[len(choice.logprobs) - len(token_ids):]
    return chat_logprobs(token_ids, window, body.top_logprobs or 0)


async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState) -> Response:
    state.check_model(body.model)
    prompt = await state.off_loop(lambda: render_chat(
        state, body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs))
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, body.max_new_tokens, num_logprobs)
    request_id, created = new_request_id("chatcmpl"), int(time.time())
    first, outputs = await submit(state, request, request_id, [prompt], params, "messages",
                                  add_special_tokens=False)
    if body.stream:
        return sse_response(_stream(body, state, request_id, created, first, outputs))
    final: RequestOutput = first[1]
    async for _, output in outputs:
        final = output
    usage = Usage()
    usage.add_request(final)
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=_logprobs(body, c, c.token_ids), finish_reason=c.finish_reason,
                          stop_reason=c.stop_reason) for c in final.outputs]
    response = ChatCompletionResponse(id=request_id, created=created, model=state.model_name,
                                      choices=choices, usage=usage)
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(body: ChatCompletionRequest, state: ServerState, request_id: str, created: int,
                  first: Indexed, outputs: AsyncIterator[Indexed]) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(*choices: ChatChunkChoice, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                   choices=list(choices), usage=usage)

    # The role comes first and alone, as OpenAI sends it.
    yield chunk(*(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                  for i in range(body.n)))
    usage = Usage()
    async for _, output in chain(first, outputs):
        for c in output.outputs:
            if c.delta_token_ids or c.delta_text or c.finish_reason is not None:
                yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.delta_text),
                                            logprobs=_logprobs(body, c, c.delta_token_ids),
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        if output.finished:
            usage.add_request(output)
    if body.stream_options and body.stream_options.include_usage:
        yield chunk(usage=usage)
