"""The engine behind the HTTP server: an engine loop in its own thread, asyncio in front.

Requests and aborts cross into the loop thread through a thread-safe queue and are applied
between steps; outputs cross back with `loop.call_soon_threadsafe`. Torch releases the GIL
in its kernels, so the event loop keeps serving while a step runs, and vice versa.

`from_config` also loads the model on the engine thread, so that one thread runs every torch
op of the process. Each thread that runs a parallel op owns an OpenMP team whose workers stay
alive; once the process holds more OpenMP threads than CPUs, libgomp stops spinning at its
barriers and sleeps at each one instead. Loading on the main thread and stepping on this one
made a single-sequence decode step three times slower on a 2-core machine (BENCHMARKS.md,
"Figures that were in code comments").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable, TypeVar

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from .sequence import Request
from .stats import EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")

STALL_SECONDS = 300.0  # a loop with work that has not finished a step for this long is stuck


class EngineDeadError(RuntimeError):
    """The engine loop failed; every in-flight request gets this error."""


class RequestFailedError(RuntimeError):
    """Handling this one request failed inside the engine; the engine itself goes on."""


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[RequestOutput | BaseException]"


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        """`engine`, or a function that builds it on the engine thread (see the module docstring);
        returns once the engine exists, raising what building it raised. `on_dead` is called
        on the engine thread if the loop fails (the server exits so the kubelet restarts it)."""
        self._inbox: "queue.SimpleQueue[tuple[str, Any, BaseException | None]]" = queue.SimpleQueue()
        self.on_dead = on_dead
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _snapshot, _num_pending_adds and _stopped
        self._num_pending_adds = 0
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._busy_since: float | None = None
        built: "Future[LLMEngine]" = Future()
        self._thread = threading.Thread(target=self._run_loop, args=(engine, built),
                                        name="kubeinfer-engine", daemon=True)
        self._thread.start()
        engine = built.result()   # the thread has set self.engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.served_model_name = engine.served_model_name
        self.generation_defaults = engine.generation_defaults
        self.task = engine.task   # generate | embed
        self.pooler_config = engine.pooler.config if engine.pooler is not None else None
        self.kv_events = engine.kv.events   # thread-safe: read by GET /kv/blocks
        self.adapters = engine.adapters     # LoRA registry (its queries are thread-safe); None without LoRA

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(lambda: LLMEngine(config))

    # -- the asyncio side ---------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | list[int] | Request,
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request (a prompt and its params, or a Request already made
        by `engine.make_request`); leaving the iteration early aborts it. A request that
        fails inside the engine raises RequestFailedError."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.")
        request = prompt if isinstance(prompt, Request) else self.engine.make_request(
            request_id, prompt, params or SamplingParams())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:   # against shutdown: an add queued before the stop is drained, none after
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            self._streams[request_id] = stream
            self._num_pending_adds += 1
            self._inbox.put(("add", request, None))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise (InvalidRequestError if item.client_error else RequestFailedError)(item.error)
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     prompt_param: str = "prompt", add_special_tokens: bool = True,
                     adapter: str | None = None) -> Request:
        """Validate and tokenize (see LLMEngine.make_request); safe to call from any thread."""
        return self.engine.make_request(request_id, prompt, params, prompt_param, add_special_tokens, adapter)

    async def run_in_engine(self, work: Callable[[LLMEngine], T]) -> T:
        """`work(engine)` on the engine thread, between steps (e.g. registering a LoRA adapter);
        raises what it raises."""
        if self._error is not None or self._stopped:
            raise EngineDeadError("the engine is not running")
        done: "Future[T]" = Future()
        self._inbox.put(("call", (work, done), None))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def make_pooling_request(self, request_id: str, prompt: str | list[int], dimensions: int | None = None,
                             prompt_param: str = "input", add_special_tokens: bool = True,
                             priority: int = 0) -> Request:
        """An embedding request (see LLMEngine.make_pooling_request); safe to call from any thread."""
        return self.engine.make_pooling_request(request_id, prompt, dimensions, prompt_param,
                                                add_special_tokens, priority)

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output grammar into the engine's cache (blocking: the server
        calls it on a worker thread, so the request's own make_request finds it compiled)."""
        self.engine.grammars.compile(spec)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Stop a request and free its blocks; its stream ends with an "abort" output, or
        raises `error` when one is given."""
        self._inbox.put(("abort", request_id, error))
        self._wake.set()

    def abort_all(self, error: BaseException) -> None:
        """Fail every open stream with `error` (e.g. the drain timeout expired)."""
        for request_id in list(self._streams):
            self.abort(request_id, error)

    def stats(self) -> EngineStats:
        with self._lock:
            return dataclasses.replace(
                self._snapshot, num_waiting=self._snapshot.num_waiting + self._num_pending_adds)

    def is_alive(self) -> bool:
        if self._error is not None or not self._thread.is_alive():
            return False
        busy_since = self._busy_since
        if busy_since is None:
            return True
        last_progress = max(busy_since, self._snapshot.last_step_time)
        return time.monotonic() - last_progress < STALL_SECONDS

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    async def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self.kv_events is not None:   # the KV-event publisher's sockets and thread
            self.kv_events.close()

    # -- the engine thread --------------------------------------------------------------------

    def _run_loop(self, engine: LLMEngine | Callable[[], LLMEngine], built: "Future[LLMEngine]") -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as error:  # noqa: BLE001 - raised again by __init__
            built.set_exception(error)
            return
        self._snapshot = self.engine.stats()
        built.set_result(self.engine)
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._busy_since = None
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                if self._busy_since is None:
                    self._busy_since = time.monotonic()
                outputs = self.engine.step()
                self._publish_stats()
                self._deliver_all([(output.request_id, output) for output in outputs])
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            log.exception("engine loop failed")
            self._error = error
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine loop failed: {error!r}"))
            if self.on_dead is not None:
                self.on_dead(error)
        finally:  # shutting down: whoever still waits gets a final "abort" output
            if self._error is None:
                self._drain_inbox()
            for request_id in list(self.engine.requests):
                final = self.engine.abort_request(request_id)
                if final is not None and self._error is None:
                    self._deliver(request_id, final)
            self._publish_stats()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, error = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                work, done = payload
                try:
                    done.set_result(work(self.engine))
                except Exception as raised:  # noqa: BLE001 - the caller's to handle
                    done.set_exception(raised)
            elif kind == "add":
                assert isinstance(payload, Request)
                with self._lock:
                    self._num_pending_adds -= 1
                if payload.request_id in self._streams:  # not already abandoned
                    self.engine.add_request(payload.request_id, payload)
            else:
                assert isinstance(payload, str)
                final = self.engine.abort_request(payload)
                if final is not None or error is not None:
                    self._deliver(payload, error if error is not None else final)
        self._publish_stats()

    def _publish_stats(self) -> None:
        snapshot = self.engine.stats()
        with self._lock:
            self._snapshot = snapshot

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """One wake-up per event loop for all of a step's outputs: at 32 streams, one callback
        per output was 32 self-pipe writes and 32 loop iterations per step."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[str, _Stream, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((request_id, stream, item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                for request_id, _, _ in batch:
                    self._streams.pop(request_id, None)


def _put_all(batch: list[tuple[str, _Stream, RequestOutput | BaseException]]) -> None:
    for _, stream, item in batch:
        stream.queue.put_nowait(item)
