"""Engine output streams as the HTTP side consumes them: merged across prompts, measured,
and cut the moment the client goes away (closing an engine stream aborts its request)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import InvalidRequestError, SamplingParams
from ..engine.sequence import Request as EngineRequest
from .metrics import ServerMetrics
from .state import ServerState
from .structured import GRAMMAR_COMPILED


Indexed = tuple[int, RequestOutput]  # (prompt index, output) from a multi-prompt request


class ClientDisconnected(Exception):
    """The client closed the connection; its engine requests were aborted."""


async def measured(outputs: AsyncIterator[RequestOutput], metrics: ServerMetrics, num_choices: int,
                   on_finished: Sequence[Callable[[RequestOutput], None]] = ()) -> AsyncIterator[RequestOutput]:
    """Feed the latency histograms (and `on_finished`: the tenant's metering, the trace, with
    the last output); a stream closed before its last output counts as an abort."""
    last_delivery: dict[int, float] = {}  # per choice
    finished = rejected = False
    try:
        async for output in outputs:
            now = time.monotonic()
            for choice in output.outputs:
                if choice.delta_token_ids:
                    # Tokens delivered together reach the client together: zero gap between them.
                    previous = last_delivery.get(choice.index)
                    gap = 0.0 if previous is None else now - previous
                    metrics.observe_token_gaps(gap, len(choice.delta_token_ids) - (previous is None))
                    last_delivery[choice.index] = now
            if output.finished:
                finished = True
                metrics.observe_finished(output)
                for callback in on_finished:
                    callback(output)
            yield output
    except InvalidRequestError:
        rejected = True
        raise
    finally:
        if not finished and not rejected:
            metrics.observe_aborted(num_choices)
        await outputs.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request, items: asyncio.Queue) -> None:
    """Queue `_DISCONNECTED` behind what the streams queued when the client leaves."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    items.put_nowait(_DISCONNECTED)


_DONE = object()  # a stream's end, in the merged queue
_DISCONNECTED = object()  # the client left, in the merged queue
_tasks: set[asyncio.Future] = set()  # asyncio keeps only weak references to tasks


def _keep(task: asyncio.Future) -> asyncio.Future:
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def _pump(index: int, stream: AsyncIterator[RequestOutput], items: asyncio.Queue) -> None:
    """Move one stream's outputs into the shared queue; cancelling it aborts the request.

    NOTE: each stream is read and closed in a task of its own: Starlette cancels a
    disconnected stream with an anyio scope that would cancel any await placed in the
    consumer's cleanup again, leaving requests running.
    """
    try:
        async for output in stream:
            items.put_nowait((index, output))
        items.put_nowait(_DONE)
    except Exception as error:  # noqa: BLE001 - handed to the consumer
        items.put_nowait(error)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def merged(request: Request, streams: list[AsyncIterator[RequestOutput]],
                 on_close: Callable[[], None]) -> AsyncIterator[Indexed]:
    """Yield `(stream_index, output)` as outputs arrive from any stream.

    Raises ClientDisconnected when the client leaves, also while the request still waits
    for its first token, and the first error any stream raises. On the way out unfinished
    streams are aborted and `on_close` runs. The streams and the disconnect watcher feed one
    queue, so a token costs one queue hop whatever the number of streams (a 2,048-prompt batch
    is 2,048 streams): no per-token task or `asyncio.wait`, which were a fifth of the event
    loop's CPU per streamed token.
    """
    items: asyncio.Queue = asyncio.Queue()
    pumps = [_keep(asyncio.ensure_future(_pump(i, stream, items))) for i, stream in enumerate(streams)]
    watcher = asyncio.ensure_future(_disconnected(request, items))
    try:
        open_streams = len(streams)
        while open_streams:
            item = await items.get()
            if item is _DONE:
                open_streams -= 1
            elif item is _DISCONNECTED:
                raise ClientDisconnected()
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in (watcher, *pumps):
            task.cancel()
        on_close()


async def chain(first: Indexed, rest: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
    """The peeked first output, then the rest of the merged stream."""
    yield first
    async for item in rest:
        yield item


async def submit(state: ServerState, request: Request, request_id: str, prompts: list[str | list[int]],
                 params: SamplingParams, prompt_param: str = "prompt", add_special_tokens: bool = True,
                 adapter: str | None = None, make: Callable[[str, str | list[int]], EngineRequest] | None = None
                 ) -> tuple[Indexed, AsyncIterator[Indexed]]:
    """Admit, validate and tokenize every prompt (off the event loop), start one engine
    request per prompt and wait for the first output. `make(request_id, prompt)` builds another
    kind of engine request (embeddings) in place of `engine.make_request` with `params`.

    All prompts are checked before any is queued, and waiting for the first output before
    any byte is sent lets engine errors still become a status code instead of an error
    frame inside a 200 stream.
    """
    started = getattr(request.state, "received", None) or time.monotonic()   # middleware.RequestClock
    trace_context = state.tracing.context(request.headers) if state.tracing is not None else None
    identity = getattr(request.state, "identity", None)
    if state.tenancy is not None and identity is not None:
        requested = params.priority if "priority" in params.explicit_fields else None
        priority = state.tenancy.admit(identity, requested, len(prompts))
    state.admission.admit(len(prompts))
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.admission.release(len(prompts))

    try:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        engine = state.engine

        def make_requests() -> list[EngineRequest]:
            if make is not None:
                return [make(engine_id, prompt) for engine_id, prompt in zip(ids, prompts)]
            return [engine.make_request(engine_id, prompt, params, prompt_param, add_special_tokens, adapter)
                    for engine_id, prompt in zip(ids, prompts)]

        requests = await state.off_loop(make_requests)
        if adapter is not None:
            state.metrics.observe_lora_requests(adapter, len(requests))
        finished: list[list[Callable[[RequestOutput], None]]] = [[] for _ in requests]
        if state.tenancy is not None and identity is not None:
            for index, engine_request in enumerate(requests):
                engine_request.tenant = identity.name
                engine_request.params.priority = priority
                prompt_len = len(engine_request.prompt_token_ids)   # reserve the most it may use
                reserved = prompt_len if engine_request.pooling is not None else (
                    prompt_len + params.n * (engine_request.max_total_tokens - prompt_len))
                state.tenancy.limiter.reserve(identity.name, reserved)
                finished[index].append(state.tenancy.on_finished(identity, reserved))
        if state.tracing is not None:
            tenant = identity.label if identity is not None else None
            for index, engine_request in enumerate(requests):
                finished[index].append(functools.partial(state.tracing.finished, trace_context, started,
                                                         model=state.model_name, params=engine_request.params,
                                                         tenant=tenant, grammar=GRAMMAR_COMPILED.get()))
        streams = [measured(engine.generate(r.request_id, r), state.metrics, params.n, done)
                   for r, done in zip(requests, finished)]
        outputs = merged(request, streams, release)
        first = await anext(outputs)
    except BaseException:
        release()
        raise
    return first, outputs
