"""The admin port (--admin-port): runtime LoRA loading, /kv/blocks and /tokenizer_info answer there
only, to no user's API key needed or taken, while the public port refuses them even with a valid
key; load errors never tell the caller what the pod's filesystem holds; a keyed engine publishes
only keyed block hashes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from helpers.lora_adapters import make_peft_adapter
from helpers.tiny_models import build_tiny_llama

from kubeinfer.server.engine.kv_events import KEYED_HASH_SCHEME, BlockHasher, block_hashes

pytestmark = pytest.mark.integration

KEY = "sk-user-1"
SECRET = "per-service-secret"
PROMPT = list(range(5, 45))   # 5 full blocks of 8
ADMIN_ROUTES = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                ("GET", "/kv/blocks"), ("GET", "/tokenizer_info")]


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("admin-port")
    base, _ = build_tiny_llama(root / "base")
    adapter = make_peft_adapter(base, root / "sql", rank=8, targets=["q_proj", "v_proj"], seed=1)[0]
    return str(base), str(adapter)


def _bound() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def two_port_server(model: str, **engine_kwargs) -> Iterator[tuple[str, str]]:
    """The app as `kubeinfer serve --admin-port` wires it; yields (public URL, admin URL)."""
    from kubeinfer.server.api.app import PortDispatch, build_admin_app, build_app
    from kubeinfer.server.api.state import ServerState
    from kubeinfer.server.engine.async_engine import AsyncEngine
    from kubeinfer.server.engine.config import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=model, dtype="float32", device="cpu",
                                                  kv_cache_memory=4 << 20, block_size=8, **engine_kwargs))
    public, admin = _bound(), _bound()
    admin_port = admin.getsockname()[1]
    try:
        state = ServerState.create(engine, model, 64)
        app = PortDispatch(build_app(state, [KEY], runtime_lora_updating=True, admin_port=True),
                           build_admin_app(state, runtime_lora_updating=True), admin_port)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        thread = threading.Thread(target=lambda: asyncio.run(server.serve([public, admin])), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{public.getsockname()[1]}", f"http://127.0.0.1:{admin_port}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    finally:
        asyncio.run(engine.shutdown())


def _router_views(url: str, admin_port: int):
    from kubeinfer.server.router.engine_views import EngineViews

    async def read():
        async with httpx.AsyncClient() as client:
            views = EngineViews(client, admin_port=admin_port, hasher=BlockHasher(SECRET))
            assert await views.fetch_tokenizer([url]) is not None
            views.metrics_interval = 0.0
            await views.refresh([url])
            return views.views[url]
    return asyncio.run(read())


def test_admin_routes_answer_on_the_admin_port_only(lora_base, tmp_path) -> None:
    base, adapter = lora_base
    load = {"lora_name": "sql", "lora_path": adapter}
    user = {"Authorization": f"Bearer {KEY}"}
    with two_port_server(base, enable_lora=True, max_lora_rank=16, kv_hash_key=SECRET) as (public, admin):
        for headers in ({}, user):   # a user's valid key opens none of them
            for method, path in ADMIN_ROUTES:
                response = httpx.request(method, public + path, json=load, headers=headers)
                assert response.status_code == 404, (path, response.text)
        assert httpx.post(admin + "/v1/load_lora_adapter", json=load).status_code == 200   # no key needed
        assert httpx.post(admin + "/v1/completions", json={"prompt": "x"}).status_code == 404
        for url, headers in ((public, user), (admin, {})):   # the operator lists adapters on the admin port
            models = httpx.get(url + "/v1/models", headers=headers).json()["data"]
            assert [card["id"] for card in models][1:] == ["sql"]
        answer = httpx.post(public + "/v1/completions", headers=user, timeout=60,
                            json={"model": "sql", "prompt": PROMPT, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        digest = httpx.get(admin + "/kv/blocks").json()
        info = httpx.get(admin + "/tokenizer_info").json()
        assert digest["hash"] == info["hash"] == KEYED_HASH_SCHEME
        # the router's prediction with the service's secret, and no unkeyed hash of the prompt
        assert set(digest["stored"]) == set(BlockHasher(SECRET).prompt(PROMPT, 8, None, "sql"))
        unkeyed = {h for salt in (None, "") for adapter_name in (None, "sql")
                   for h in block_hashes(PROMPT, 8, salt, adapter_name)}
        assert not set(digest["stored"]) & unkeyed
        # the router reads the digest, tokenizer and adapters of an engine known by its API URL
        views = _router_views(public, int(admin.rsplit(":", 1)[1]))
        assert views.cached == set(digest["stored"]) and views.adapters == {"sql"}
        assert httpx.post(admin + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200


def test_load_errors_do_not_reveal_the_filesystem(lora_base, tmp_path) -> None:
    base, _ = lora_base
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("secret")
    (tmp_path / "bad-config").mkdir()
    (tmp_path / "bad-config" / "adapter_config.json").write_text("{not json")
    with two_port_server(base, enable_lora=True, max_lora_rank=16) as (_, admin):
        answers = [httpx.post(admin + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
                   for path in (tmp_path / "missing", tmp_path / "a-file", tmp_path / "empty",
                                tmp_path / "bad-config", "/proc/self/root")]
    assert {answer.status_code for answer in answers} == {400}
    messages = {answer.json()["error"]["message"] for answer in answers}
    assert len(messages) == 1, messages
    assert str(tmp_path) not in messages.pop()
