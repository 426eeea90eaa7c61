"""POST /v1/chat/completions: messages rendered with the model's own chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import CompletionOutput, RequestOutput
from .errors import OpenAIError
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, ChatMessage
from .responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                        ChatCompletionResponse, DeltaMessage, DeltaToolCall, FunctionCallOut,
                        ToolCallOut, Usage, prompt_logprobs)
from .sampling import sampling_params
from .sse import sse_response
from .state import ServerState, new_request_id
from .streams import Indexed, chain, submit
from .structured import compile_ahead, constrain, structured_outputs
from .tools import ToolCallStream, ToolPlan, plan_tools, template_messages


def render_chat(state: ServerState, messages: list[ChatMessage] | list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text (`Tokenizer.chat_prompt`, which the router repeats); it already holds any
    BOS, so none is added when tokenizing. `messages` may already be in the template's form
    (server/api/tools.py rewrites them) and `tools` go to the template's `tools` variable.

    `template_kwargs` are extra template variables (vLLM's `chat_template_kwargs`): there,
    `add_generation_prompt` and `continue_final_message` override the request's fields as in
    vLLM, while `messages` is the server's own and refused. Any failure of the template on
    this input is the client's 400, never a 500.
    """
    if "messages" in (template_kwargs or {}):
        raise OpenAIError(400, "chat_template_kwargs.messages: the template's messages come from the "
                          "request's 'messages' field", param="chat_template_kwargs.messages")
    if tools is not None:
        template_kwargs = {**(template_kwargs or {}), "tools": tools}
    try:
        return state.engine.tokenizer.chat_prompt([m if isinstance(m, dict) else m.to_template() for m in messages],
                                                  add_generation_prompt, continue_final_message, template_kwargs)
    except Exception as exc:  # noqa: BLE001 - ChatTemplateError, or a template tripping on odd kwargs
        raise OpenAIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc


async def render_request(state: ServerState, body: ChatCompletionRequest) -> tuple[str, ToolPlan | None]:
    """The request's prompt text (tools shown as its template or our fallback shows them) and
    its tool plan; /tokenize renders messages the same way."""
    template = state.engine.tokenizer.chat_template
    plan = plan_tools(body, template)
    messages, tools = template_messages(body, plan, template)
    prompt = await state.off_loop(lambda: render_chat(
        state, messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs, tools))
    return prompt, plan


def _logprobs(body: ChatCompletionRequest, choice: CompletionOutput, token_ids: list[int]):
    if not body.logprobs or choice.logprobs is None:
        return None
    window = choice.logprobs[len(choice.logprobs) - len(token_ids):]
    return chat_logprobs(token_ids, window, body.top_logprobs or 0)


async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState) -> Response:
    adapter = state.resolve_model(body.model)
    model_name = adapter or state.model_name
    state.check_task("generate", "Chat Completions")
    prompt, plan = await render_request(state, body)
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, body.max_new_tokens, num_logprobs)
    params.prompt_logprobs = body.prompt_logprobs
    forced = plan.constraint() if plan is not None else None
    if forced is not None:
        if structured_outputs(body) is not None:
            raise OpenAIError(400, "a forced tool call (tool_choice 'required' or a named function) cannot be "
                              "combined with response_format or other structured outputs", param="tool_choice")
        await compile_ahead(state.engine, forced, "tools")
        params.structured_outputs = forced
    else:
        await constrain(state.engine, body, params)
    request_id, created = new_request_id("chatcmpl"), int(time.time())
    first, outputs = await submit(state, request, request_id, [prompt], params, "messages",
                                  add_special_tokens=False, adapter=adapter)
    if body.stream:
        return sse_response(_stream(body, model_name, request_id, created, first, outputs, plan))
    final: RequestOutput = first[1]
    async for _, output in outputs:
        final = output
    usage = Usage()
    usage.add_request(final)
    choices = [_choice(body, plan, c) for c in final.outputs]
    response = ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                      usage=usage, prompt_logprobs=prompt_logprobs(final.prompt_logprobs))
    return JSONResponse(response.model_dump(mode="json"))


def _choice(body: ChatCompletionRequest, plan: ToolPlan | None, c: CompletionOutput) -> ChatChoice:
    content: str | None = c.text
    calls: list[ToolCallOut] = []
    if plan is not None:
        content, parsed = plan.parse(c.text)
        calls = [ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
                 for call in parsed]
    return ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                      logprobs=_logprobs(body, c, c.token_ids), finish_reason=_finish_reason(c, bool(calls)),
                      stop_reason=c.stop_reason)


def _finish_reason(c: CompletionOutput, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model ended its turn with calls; "length" stays."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


async def _stream(body: ChatCompletionRequest, model_name: str, request_id: str, created: int,
                  first: Indexed, outputs: AsyncIterator[Indexed], plan: ToolPlan | None = None
                  ) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(*choices: ChatChunkChoice, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=model_name,
                                   choices=list(choices), usage=usage)

    # The role comes first and alone, as OpenAI sends it.
    yield chunk(*(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                  for i in range(body.n)))
    usage = Usage()
    calls = {i: ToolCallStream(plan) for i in range(body.n)} if plan is not None else {}
    async for _, output in chain(first, outputs):
        for c in output.outputs:
            if c.delta_token_ids or c.delta_text or c.finish_reason is not None:
                delta, finish_reason = DeltaMessage(content=c.delta_text), c.finish_reason
                if plan is not None:
                    delta, finish_reason = _tool_delta(calls[c.index], c)
                yield chunk(ChatChunkChoice(index=c.index, delta=delta,
                                            logprobs=_logprobs(body, c, c.delta_token_ids),
                                            finish_reason=finish_reason, stop_reason=c.stop_reason))
        if output.finished:
            usage.add_request(output)
    if body.stream_options and body.stream_options.include_usage:
        yield chunk(usage=usage)


def _tool_delta(stream: ToolCallStream, c: CompletionOutput) -> tuple[DeltaMessage, str | None]:
    content, calls = stream.feed(c.delta_text)
    if c.finish_reason is not None:
        rest, last = stream.finish()
        content, calls = content + rest, calls + last
    delta = DeltaMessage(content=content or None, tool_calls=[DeltaToolCall.model_validate(call) for call in calls]
                         or None)
    return delta, (_finish_reason(c, stream.num_calls > 0) if c.finish_reason is not None else None)
