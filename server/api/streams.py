"""Engine output streams as the HTTP side consumes them: merged across prompts, measured,
and cut the moment the client goes away (closing an engine stream aborts its request)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from kubeinfer.server.api.metrics import ServerMetrics
from kubeinfer.server.api.state import ServerState
from kubeinfer.server.engine.outputs import RequestOutput
from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams


Indexed = tuple[int, RequestOutput]  # (prompt index, output) from a multi-prompt request


class ClientDisconnected(Exception):
    """The client closed the connection; its engine requests were aborted."""


async def measured(outputs: AsyncIterator[RequestOutput], metrics: ServerMetrics,
                   num_choices: int) -> AsyncIterator[RequestOutput]:
    """Feed the latency histograms; a stream closed before its last output counts as an abort."""
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
            yield output
    except InvalidRequestError:
        rejected = True
        raise
    finally:
        if not finished and not rejected:
            metrics.observe_aborted(num_choices)
        await outputs.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(request: Request, streams: list[AsyncIterator[RequestOutput]],
                 on_close: Callable[[], None]) -> AsyncIterator[Indexed]:
    """Yield `(stream_index, output)` as outputs arrive from any stream.

    Raises ClientDisconnected when the client leaves, also while the request still waits
    for its first token. On the way out unfinished streams are aborted and `on_close` runs.
    """
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        while pending:
            done, _ = await asyncio.wait({*pending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise ClientDisconnected()
            for task in done:
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, output
    finally:
        # NOTE: closing the streams (which aborts their engine requests) runs in a task of its
        # own: Starlette cancels a disconnected stream with an anyio scope that would cancel
        # any await placed here again, leaving requests running.
        for task in (*pending, watcher):
            task.cancel()
        cleanup = asyncio.ensure_future(_close(list(pending), streams))
        _cleanups.add(cleanup)
        cleanup.add_done_callback(_cleanups.discard)
        on_close()


_cleanups: set[asyncio.Future] = set()  # asyncio keeps only weak references to tasks


async def _close(cancelled: list[asyncio.Future], streams: list[AsyncIterator[RequestOutput]]) -> None:
    await asyncio.gather(*cancelled, return_exceptions=True)
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]


async def chain(first: Indexed, rest: AsyncIterator[Indexed]) -> AsyncIterator[Indexed]:
    """The peeked first output, then the rest of the merged stream."""
    yield first
    async for item in rest:
        yield item


async def submit(state: ServerState, request: Request, request_id: str, prompts: list[list[int]],
                 params: SamplingParams) -> tuple[Indexed, AsyncIterator[Indexed]]:
    """Admit, start one engine request per prompt and wait for the first output.

    Waiting for it before any byte is sent lets engine validation errors still become a
    400 instead of an error frame inside a 200 stream.
    """
    state.admission.admit(len(prompts))
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.admission.release(len(prompts))

    try:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [measured(state.engine.generate(engine_id, prompt, params), state.metrics, params.n)
                   for engine_id, prompt in zip(ids, prompts)]
        outputs = merged(request, streams, release)
        first = await anext(outputs)
    except BaseException:
        release()
        raise
    return first, outputs
