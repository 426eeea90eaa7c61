"""POST /v1/completions: text or token-id prompts (one or a list), streamed or not; `echo`
puts each prompt (text and logprobs) in front of its completions, as OpenAI and vLLM do."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..engine.outputs import CompletionOutput, RequestOutput
from .logprobs import completion_logprobs, joined
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage
from .responses import prompt_logprobs as prompt_logprobs_out
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


class Echo:
    """What `echo` puts in front of each completion of one prompt: its text (as given, or the
    token ids decoded) and, with `logprobs`, its tokens' logprobs (the first one null)."""

    def __init__(self, body: CompletionRequest, text: str, decode: Callable[[list[int]], str]) -> None:
        self.body, self.text, self.decode = body, text, decode

    def logprobs(self, output: RequestOutput) -> CompletionLogprobs | None:
        if self.body.logprobs is None or output.prompt_logprobs is None:
            return None
        ids = output.prompt_token_ids
        return completion_logprobs(ids, output.prompt_logprobs, 0, self.body.logprobs, self.decode(ids[:1]))


def _choice(body: CompletionRequest, prompt_index: int, output: RequestOutput, choice: CompletionOutput,
            text: str, token_ids: list[int], offset: int, echo: Echo | None, whole: bool = True) -> CompletionChoice:
    """`text` and `token_ids` are the part being sent (all of it, or a stream delta when not
    `whole`) and `offset` is where that text starts in the completion; `echo`: the prompt goes
    in front. vLLM's `prompt_logprobs` ride on whole choices only (never on a stream's)."""
    logprobs = None
    if body.logprobs is not None and choice.logprobs is not None:
        window = choice.logprobs[len(choice.logprobs) - len(token_ids):]
        logprobs = completion_logprobs(token_ids, window, offset + (len(echo.text) if echo else 0))
    finish_reason = choice.finish_reason
    if echo is not None:
        prompt_logprobs = echo.logprobs(output)
        if body.echo_only:   # the engine's one token is not part of the answer
            text, logprobs, finish_reason = "", None, "length"
        text = echo.text + text
        if prompt_logprobs is not None:
            logprobs = joined(prompt_logprobs, logprobs) if logprobs is not None else prompt_logprobs
    return CompletionChoice(index=prompt_index * body.n + choice.index, text=text, logprobs=logprobs,
                            finish_reason=finish_reason, stop_reason=None if body.echo_only else choice.stop_reason,
                            prompt_logprobs=prompt_logprobs_out(output.prompt_logprobs) if whole else None)


async def _echoes(state: ServerState, body: CompletionRequest, prompts: list[str | list[int]]
                  ) -> list[Echo] | None:
    """Each prompt's echo (token-id prompts decoded, off the loop), or None without `echo`."""
    if not body.echo:
        return None
    tokenizer = state.engine.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    texts = await state.off_loop(lambda: [p if isinstance(p, str) else decode(p) for p in prompts])
    return [Echo(body, text, decode) for text in texts]


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    adapter = state.resolve_model(body.model)
    model_name = adapter or state.model_name
    state.check_task("generate", "Completions")
    prompts = _prompts(body)
    params = sampling_params(body, 1 if body.echo_only else body.max_tokens, body.logprobs)
    # vLLM's rule: `echo` with `logprobs` scores the prompt at that many alternatives
    params.prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (
        body.logprobs if body.echo else None)
    await constrain(state.engine, body, params)
    request_id, created = new_request_id("cmpl"), int(time.time())
    first, outputs = await submit(state, request, request_id, prompts, params, adapter=adapter)
    echoes = await _echoes(state, body, prompts)
    if body.stream:
        return sse_response(_stream(body, model_name, request_id, created, first, outputs, echoes))
    finals: dict[int, RequestOutput] = {}
    async for index, output in chain(first, outputs):
        finals[index] = output
    usage, choices = Usage(), []
    for index, output in sorted(finals.items()):
        usage.add_request(output, generated=not body.echo_only)
        echo = echoes[index] if echoes is not None else None
        choices += [_choice(body, index, output, c, c.text, c.token_ids, 0, echo) for c in output.outputs]
    response = CompletionResponse(id=request_id, created=created, model=model_name,
                                  choices=sorted(choices, key=lambda c: c.index), usage=usage)
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(body: CompletionRequest, model_name: str, request_id: str, created: int,
                  first: Indexed, outputs: AsyncIterator[Indexed], echoes: list[Echo] | None
                  ) -> AsyncIterator[CompletionResponse]:
    usage = Usage()
    echoed: set[tuple[int, int]] = set()   # (prompt, choice) whose first chunk carried the prompt
    async for index, output in chain(first, outputs):
        for choice in output.outputs:
            if not choice.delta_token_ids and not choice.delta_text and choice.finish_reason is None:
                continue
            echo = None
            if echoes is not None and (index, choice.index) not in echoed:
                echo = echoes[index]
                echoed.add((index, choice.index))
            elif body.echo_only:
                continue
            offset = len(choice.text) - len(choice.delta_text) + (len(echoes[index].text) if echoes and not echo else 0)
            yield CompletionResponse(id=request_id, created=created, model=model_name, choices=[
                _choice(body, index, output, choice, choice.delta_text, choice.delta_token_ids, offset, echo,
                        whole=False)])
        if output.finished:
            usage.add_request(output, generated=not body.echo_only)
    if body.stream_options and body.stream_options.include_usage:
        yield CompletionResponse(id=request_id, created=created, model=model_name, choices=[],
                                 usage=usage)
