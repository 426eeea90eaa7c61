"""`kubeinfer serve`: load the engine, serve the API with uvicorn, drain on SIGTERM.

Kubernetes sends SIGTERM and keeps routing for a moment; so on the first signal readiness
fails and new requests get 503 while in-flight ones finish (up to --shutdown-timeout),
then the process exits 0. When the timeout expires first, every open stream still gets an
error event and `data: [DONE]`, and every waiting request a 503 with Retry-After, so no
client mistakes a cut for a finished answer. A second signal exits at once.

If the engine loop dies, /ready and /health fail at once, open streams get an error event,
and the process exits 1 so the kubelet restarts it now rather than after its liveness
probe has failed several times.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import time
from types import FrameType
from typing import Callable

import uvicorn

from kubeinfer.kernels import ops_cpu
from .. import exit_codes
from ..flags import ENGINE_FLAGS, SERVER_FLAGS, add_flags
from .admission import Admission
from ..credentials import CredentialFiles
from .errors import OpenAIError

logger = logging.getLogger("kubeinfer.serve")

_ANSWER_GRACE_SECONDS = 2.0  # for failed requests to write their last bytes before exit


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the socket."""

    def __init__(self, config: uvicorn.Config, admission: Admission, shutdown_timeout: float,
                 abort_all: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(config)
        self.admission, self.shutdown_timeout = admission, shutdown_timeout
        self.abort_all = abort_all
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None
        self.engine_error: BaseException | None = None

    def engine_died(self, error: BaseException) -> None:
        """Called on the engine thread: answers already went out with the error; now exit."""
        self.engine_error = error
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._exit_after_answers)

    def _exit_after_answers(self) -> None:
        asyncio.ensure_future(self._wait_then_exit(_ANSWER_GRACE_SECONDS))

    async def _wait_then_exit(self, grace: float) -> None:
        """Let requests that were just failed write their answers, then stop serving."""
        deadline = time.monotonic() + grace
        while self.admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True

    async def serve(self, sockets: list | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not recording the signal keeps uvicorn from re-raising it on exit (exit code 0).
        if self.admission.draining or self.loop is None:
            self.should_exit = self.force_exit = True
            return
        logger.info("signal %s: draining (up to %.0fs) before exit", signal.Signals(sig).name,
                    self.shutdown_timeout)
        self.admission.draining = True  # readiness fails from this instant
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        if await self.admission.drain(self.shutdown_timeout):
            logger.info("drained: all in-flight requests finished")
            self.should_exit = True
            return
        logger.warning("shutdown timeout: failing %d requests still in flight", self.admission.in_flight)
        if self.abort_all is not None:
            self.abort_all(OpenAIError(503, "the server shut down before this request finished; retry "
                                       "on another replica", code="shutdown", headers={"Retry-After": "1"}))
        await self._wait_then_exit(_ANSWER_GRACE_SECONDS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ENGINE_FLAGS + SERVER_FLAGS)


async def _serve(args: argparse.Namespace, files: CredentialFiles) -> int:
    """Serve until drained (0) or until the engine loop dies (1); `files`: the key files, read."""
    from ..engine.async_engine import AsyncEngine
    from ..engine.config import EngineConfig
    from .app import PortDispatch, build_admin_app, build_app
    from ..tenancy import tenancy_enabled
    from .auth import ApiKeyCheck
    from .state import ServerState
    from .tenancy import Tenancy

    table = files.current.table
    if tenancy_enabled(args) and args.scheduling_policy == "auto":
        args.scheduling_policy = "fair"
    engine = AsyncEngine.from_config(EngineConfig.from_args(args))
    if args.device in ("auto", "cpu"):   # the attention kernels: now, off the loading path
        ops_cpu.start_building()
    tracing = None
    try:
        state = ServerState.create(engine, args.model_source, args.max_queued_requests)
        if args.otlp_traces_endpoint:
            from .tracing import Tracing

            tracing = state.tracing = Tracing(args.otlp_traces_endpoint, args.otlp_traces_sampling_ratio,
                                              engine.served_model_name)
        files.count_reloads(state.metrics.registry)
        if tenancy_enabled(args):
            state.tenancy = Tenancy(table, args.trust_tenant_header, args.api_keys, state.metrics.registry,
                                           engine.served_model_name, args.log_usage, files)
        from .lora import runtime_updating_allowed

        runtime_lora = runtime_updating_allowed(args.allow_runtime_lora_updating) and args.enable_lora
        app = build_app(state, ApiKeyCheck.following(files), args.max_request_body_bytes, runtime_lora,
                        admin_port=args.admin_port is not None, tenancy=state.tenancy)
        sockets = None
        if args.admin_port is not None:
            admin = build_admin_app(state, args.max_request_body_bytes, runtime_lora)
            app = PortDispatch(app, admin, args.admin_port)
            sockets = [uvicorn.Config(app, host=args.host, port=port).bind_socket()
                       for port in (args.port, args.admin_port)]
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=1, timeout_keep_alive=5)
        server = DrainingServer(config, state.admission, args.shutdown_timeout, engine.abort_all)
        engine.on_dead = server.engine_died
        # What startup built (the model's modules, tokenizer, app) is kept for the process's life:
        # frozen, the collector's passes while serving no longer walk it (vLLM's engine does the same).
        gc.freeze()
        await server.serve(sockets)
    finally:
        await engine.shutdown()
        if tracing is not None:
            tracing.shutdown()
    if server.engine_error is not None:
        logger.error("exiting with status 1: the engine loop failed (%r)", server.engine_error)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    files = CredentialFiles.from_args(args)  # before the model loads: a bad key file fails fast
    args.api_keys = files.current.api_keys
    if args.api_keys:
        logger.info("API keys required on the OpenAI routes (%d configured)", len(args.api_keys))
    if args.device in ("auto", "cpu"):   # compile while torch imports: a fresh pod's first start
        ops_cpu.start_building(loading_only=True)
    from ..weights.fetch import use_local_copy
    from ..weights.prefetch import prefetch

    # hf:// and s3:// are fetched into the cache (once per node); the engine loads the local copy
    if code := use_local_copy(args, args.download_dir):
        return code
    if args.model != "embedded":
        prefetch(args.model)   # the disk reads the weights while torch and the engine import
    from ..model.loader import DeviceUnavailableError
    try:
        if args.headless:   # this node's ranks only: node 0 serves the API
            from ..engine.config import EngineConfig
            from ..parallel.launch import run_headless

            try:
                return run_headless(EngineConfig.from_args(args))
            except ValueError as exc:   # flags that cannot work: one line, and a restart will not help
                logger.error("%s", exc)
                exit_codes.write_termination_message(str(exc))
                return 1
        return asyncio.run(_serve(args, files))
    except DeviceUnavailableError as exc:  # one line, not a traceback, and an exit code that says so
        logger.error("%s", exc)
        exit_codes.write_termination_message(str(exc))
        return exit_codes.DEVICE_UNAVAILABLE

