"""`kubeinfer serve`: load the engine, serve the API with uvicorn, drain on SIGTERM.

Kubernetes sends SIGTERM and keeps routing for a moment; so on the first signal readiness
fails and new requests get 503 while in-flight ones finish (up to --shutdown-timeout),
then the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from kubeinfer.kernels import cpu_build
from kubeinfer.server.api.admission import Admission
from kubeinfer.server.api.auth import api_keys_from_args
from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS, add_flags

logger = logging.getLogger("kubeinfer.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the socket."""

    def __init__(self, config: uvicorn.Config, admission: Admission, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.admission, self.shutdown_timeout = admission, shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

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
        else:
            logger.warning("shutdown timeout: %d requests still in flight", self.admission.in_flight)
        self.should_exit = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ENGINE_FLAGS + SERVER_FLAGS)


async def _serve(args: argparse.Namespace) -> None:
    from kubeinfer.server.api.app import build_app
    from kubeinfer.server.api.state import ServerState
    from kubeinfer.server.engine.async_engine import AsyncEngine
    from kubeinfer.server.engine.config import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig.from_args(args))
    if args.device in ("auto", "cpu"):   # the attention kernels: now, off the loading path
        cpu_build.start_building()
    try:
        state = ServerState.create(engine, args.model, args.max_queued_requests)
        config = uvicorn.Config(build_app(state, args.api_keys), host=args.host, port=args.port,
                                log_level=args.log_level, timeout_graceful_shutdown=1,
                                timeout_keep_alive=5)
        await DrainingServer(config, state.admission, args.shutdown_timeout).serve()
    finally:
        await engine.shutdown()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.api_keys = api_keys_from_args(args)  # before the model loads: a bad key file fails fast
    if args.api_keys:
        logger.info("API keys required on the OpenAI routes (%d configured)", len(args.api_keys))
    if args.device in ("auto", "cpu"):   # compile while torch imports: a fresh pod's first start
        cpu_build.start_building(cpu_build.LOADING_KERNELS)
    asyncio.run(_serve(args))
    return 0
