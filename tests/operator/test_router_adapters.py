"""The router and LoRA adapters: it learns which engine holds which adapter from /v1/models,
hashes an adapter request in that adapter's namespace (as the engine does), and sends it
among the replicas holding the adapter."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from test_router_pickers import BS, SHARED, URLS, key, views

from kubeinfer.server.engine.kv_events import block_hashes
from kubeinfer.server.model.checkpoints.tokenizer_files import load_tokenizer
from kubeinfer.server.router.engine_views import EngineViews
from kubeinfer.server.router.pickers import PrefixAware
from kubeinfer.server.router.routing_key import KeyMaker, RoutingKey

pytestmark = pytest.mark.unit


def adapter_key(tokens: list[int], adapter: str) -> RoutingKey:
    base = key(tokens)
    return RoutingKey(base.num_tokens, BS, tuple(block_hashes(tokens[:-1], BS, None, adapter)), base.affinity,
                      adapter=adapter)


def test_an_adapter_request_goes_to_a_replica_holding_the_adapter() -> None:
    state = views({"http://a": SHARED})   # a has the base model's prefix cached, but not the adapter
    state.get("http://c").adapters = frozenset({"sql"})
    for tokens in (SHARED + [1], [7] * 40):
        assert PrefixAware(state).pick(URLS, adapter_key(tokens, "sql"), {}).url == "http://c"
    assert PrefixAware(state).pick(URLS, key(SHARED + [1]), {}).url == "http://a"   # the base: by prefix


def test_an_adapter_nobody_holds_yet_routes_like_any_request() -> None:
    state = views()
    assert PrefixAware(state).pick(URLS, adapter_key([7] * 40, "new"), {}).url in URLS


def test_adapter_prefixes_match_only_their_own_adapter() -> None:
    state = views()
    state.get("http://b").apply({"hash": "kubeinfer-blake2b64-v1", "block_size": BS, "epoch": "e", "seq": 1,
                                 "reset": True, "stored": block_hashes(SHARED, BS, None, "sql"), "removed": []})
    for url in ("http://b", "http://c"):
        state.get(url).adapters = frozenset({"sql", "chat"})
    picker = PrefixAware(state)
    assert picker.pick(URLS, adapter_key(SHARED + [1], "sql"), {}).reason == "prefix"
    assert picker.pick(URLS, adapter_key(SHARED + [1], "chat"), {}).reason != "prefix"


def test_keys_use_the_adapter_namespace_when_the_model_is_an_adapter() -> None:
    maker = KeyMaker(load_tokenizer("embedded"), BS)
    body = {"prompt": "word " * 80}
    base = maker.make("/v1/completions", json.dumps(body).encode(), {}, adapters={"sql"})
    sql = maker.make("/v1/completions", json.dumps({**body, "model": "sql"}).encode(), {}, adapters={"sql"})
    unknown = maker.make("/v1/completions", json.dumps({**body, "model": "gone"}).encode(), {}, adapters={"sql"})
    assert base is not None and sql is not None and unknown is not None
    assert sql.adapter == "sql" and base.adapter is None and unknown.adapter is None
    ids = _ids(maker, body)
    assert sql.hashes == tuple(block_hashes(ids[:-1], BS, None, "sql"))
    assert set(sql.hashes).isdisjoint(base.hashes) and unknown.hashes == base.hashes


def _ids(maker: KeyMaker, body: dict) -> list[int]:
    found = maker.prompt_ids("/v1/completions", body)
    assert found is not None
    return found[0]


def test_views_learn_each_engines_adapters_from_v1_models() -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            assert request.headers.get("authorization") == "Bearer k"
            held = ["sql"] if request.url.host == "a" else []
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "base", "root": "base", "parent": None},
                *({"id": n, "root": f"/adapters/{n}", "parent": "base"} for n in held)]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 0\n")
        return httpx.Response(404)

    async def poll() -> EngineViews:
        async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
            state = EngineViews(client)
            state.api_key = "k"
            await state.refresh(["http://a", "http://b"])
            return state

    state = asyncio.run(poll())
    assert state.get("http://a").adapters == {"sql"} and state.get("http://b").adapters == frozenset()
    assert state.adapters() == {"sql"}
