"""Live uvicorn servers on 127.0.0.1 (port 0) in a background thread, for tests that need
real sockets: streaming clients, disconnects, the official openai client."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn


@contextlib.contextmanager
def serve_in_thread(app: object) -> Iterator[str]:
    """Run `app` until the block exits; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def live_server():
    return serve_in_thread


@contextlib.contextmanager
def engine_server(model: str, *, api_keys: list[str] | None = None, max_queued_requests: int = 1024,
                  max_body_bytes: int | None = None, **engine_kwargs: object) -> Iterator[tuple[str, object]]:
    """The real AsyncEngine on `model` behind the real app; yields (base URL, ServerState)."""
    import asyncio

    from kubeinfer.server.api.app import build_app
    from kubeinfer.server.api.state import ServerState
    from kubeinfer.server.engine.async_engine import AsyncEngine
    from kubeinfer.server.engine.config import EngineConfig

    config = EngineConfig(model=model, dtype="float32", device="cpu", **engine_kwargs)  # type: ignore[arg-type]
    engine = AsyncEngine.from_config(config)
    try:
        state = ServerState.create(engine, model, max_queued_requests)
        with serve_in_thread(build_app(state, api_keys or [], max_body_bytes)) as url:
            yield url, state
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from helpers.tiny_models import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def start_server():
    return engine_server
