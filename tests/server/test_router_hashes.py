"""The router's block hashes for a request equal the engine's: a router that tokenizes with the
engine's `/tokenizer_info` (or the model's own files) predicts exactly the blocks the engine
publishes at `/kv/blocks` and the cached tokens it then reports, for several chat templates,
completions and cache salts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from kubeinfer.server.engine.kv_events import HASH_SCHEME, UNKEYED, BlockHasher, block_hashes
from kubeinfer.server.model.checkpoints.tokenizer_files import load_tokenizer
from kubeinfer.server.router.engine_views import EngineView, EngineViews
from kubeinfer.server.router.routing_key import KeyMaker

pytestmark = pytest.mark.integration

SYSTEM = ("You are the support assistant of a company that sells garden tools. Answer briefly, "
          "politely and only about gardening; refuse anything else. ") * 3
# A Llama-3-style template: BOS from the template, header tokens, tools, a default date.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '<|im_end|>\n\n' + message['content'] | trim + '<|endoftext|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\n\n' }}{% endif %}"
)


def _requests(salt: str | None) -> list[tuple[str, dict]]:
    extra = {"cache_salt": salt} if salt else {}
    chat = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Which spade for clay soil?"}], **extra}
    return [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SYSTEM}], **extra}),  # default system
        ("/v1/chat/completions", {**chat, "messages": chat["messages"] + [
            {"role": "assistant", "content": "A"}], "add_generation_prompt": False,
            "continue_final_message": True}),
        ("/v1/completions", {"prompt": SYSTEM + " Q: rakes?", **extra}),
        ("/v1/completions", {"prompt": [list(range(3, 60))], **extra}),
    ]


def _check_engine(url: str, keys: list[KeyMaker]) -> None:
    """Each request: the router's hashes are all published by the engine afterwards, and a
    repeat reports exactly the predicted blocks as cached."""
    view = EngineView(url, keys[0].hasher.scheme)
    with httpx.Client(base_url=url, timeout=60) as client:
        for salt in (None, "tenant-a", "tenant-b"):
            for path, body in _requests(salt):
                body = {**body, "max_tokens": 1, "temperature": 0}
                predicted = {key.make(path, json.dumps(body).encode(), {}) for key in keys}
                assert len(predicted) == 1, "routers built from the file and the endpoint disagree"
                key = predicted.pop()
                assert key is not None and len(key.hashes) >= 3
                first = client.post(path, json=body)
                assert first.status_code == 200, first.text
                digest = client.get("/kv/blocks", params={} if view.seq is None else {"since": view.seq})
                view.apply(digest.json())
                assert view.matched_blocks(key.hashes, 0.0) == len(key.hashes)
                again = client.post(path, json=body).json()["usage"]
                assert again["prompt_tokens"] == key.num_tokens
                assert again["prompt_tokens_details"]["cached_tokens"] == len(key.hashes) * key.block_size
        salted = [keys[0].make("/v1/completions", json.dumps({"prompt": SYSTEM, **s}).encode(), {})
                  for s in ({}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"})]
        assert len({key.hashes[0] for key in salted if key}) == 3


def _endpoint_key(url: str, hasher: BlockHasher = UNKEYED) -> KeyMaker:
    async def fetch():
        async with httpx.AsyncClient() as client:
            return await EngineViews(client, hasher=hasher).fetch_tokenizer([url])

    found = asyncio.run(fetch())
    assert found is not None
    tokenizer, block_size = found
    return KeyMaker(tokenizer, block_size, hasher=hasher)


@pytest.fixture(scope="module")
def llama3_style_model(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    import shutil

    path = tmp_path_factory.mktemp("llama3-template") / "model"
    shutil.copytree(tiny_model_path, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_TEMPLATE}))
    return str(path)


def test_tokenizer_info_describes_the_block_hashes(start_server, tiny_model_path: str) -> None:
    with start_server(tiny_model_path, block_size=8) as (url, _):
        info = httpx.get(url + "/tokenizer_info").json()
        blocks = httpx.get(url + "/kv/blocks").json()
    assert info["hash"] == blocks["hash"] == HASH_SCHEME and info["block_size"] == blocks["block_size"] == 8
    assert info["chat_template"] and info["special_tokens"]["eos_token"] == "<|im_end|>"
    assert blocks["reset"] and blocks["stored"] == [] and blocks["seq"] == 0


@pytest.mark.parametrize("block_size", [16, 8])
def test_router_hashes_equal_the_engine_blocks_chatml(start_server, tiny_model_path: str, block_size: int) -> None:
    with start_server(tiny_model_path, block_size=block_size) as (url, _):
        from_files = KeyMaker(load_tokenizer(tiny_model_path), block_size)
        _check_engine(url, [from_files, _endpoint_key(url)])


def test_keyed_router_hashes_equal_a_keyed_engines_and_no_unkeyed_hash(start_server, tiny_model_path: str) -> None:
    """With the service's secret on both sides the chain still matches block for block; the
    published digest holds no hash the public scheme gives any of the prompts."""
    hasher = BlockHasher("service-secret")
    with start_server(tiny_model_path, block_size=8, kv_hash_key="service-secret") as (url, _):
        keys = [KeyMaker(load_tokenizer(tiny_model_path), 8, hasher=hasher), _endpoint_key(url, hasher)]
        _check_engine(url, keys)
        published = set(httpx.get(url + "/kv/blocks").json()["stored"])
        async def unkeyed_views() -> object:
            async with httpx.AsyncClient() as client:
                return await EngineViews(client).fetch_tokenizer([url])
        assert asyncio.run(unkeyed_views()) is None   # an unkeyed router learns no key scheme it cannot match
    plain = KeyMaker(load_tokenizer(tiny_model_path), 8)
    unkeyed = {h for salt in (None, "tenant-a", "tenant-b") for path, body in _requests(salt)
               for h in plain.make(path, json.dumps({**body, "max_tokens": 1}).encode(), {}).hashes}
    assert len(published) > 20 and not published & unkeyed
    assert not published & set(block_hashes(list(range(3, 60)), 8))


def test_router_hashes_equal_the_engine_blocks_llama3_style(start_server, llama3_style_model: str) -> None:
    assert Path(llama3_style_model, "tokenizer_config.json").read_text().count("bos_token")
    with start_server(llama3_style_model) as (url, _):
        _check_engine(url, [KeyMaker(load_tokenizer(llama3_style_model), 16), _endpoint_key(url)])


def test_router_hashes_equal_the_engine_blocks_embedded_model(start_server) -> None:
    """SmolLM2's GGUF tokenizer and its own chat template (default system prompt included)."""
    with start_server("embedded", max_num_seqs=4, kv_cache_memory=64 * 2**20) as (url, _):
        _check_engine(url, [KeyMaker(load_tokenizer("embedded"), 16), _endpoint_key(url)])
