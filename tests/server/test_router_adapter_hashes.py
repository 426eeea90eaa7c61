"""The router's block hashes for a LoRA adapter request equal the engine's: hashed in the
adapter's namespace, the blocks the router predicts are the ones the engine publishes at
`/kv/blocks` and reports as cached, and they never match the base model's blocks."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.lora_adapters import make_peft_adapter

from kubeinfer.server.flags import LoRAModuleSpec
from kubeinfer.server.model.checkpoints.tokenizer_files import load_tokenizer
from kubeinfer.server.router.engine_views import EngineView
from kubeinfer.server.router.routing_key import KeyMaker

pytestmark = pytest.mark.integration

PROMPT = "The garden shop sells spades, rakes, hoes and shears for every kind of soil. " * 3


def test_adapter_requests_hash_in_the_adapters_namespace(start_server, tiny_model_path: str, tmp_path) -> None:
    adapter, _ = make_peft_adapter(tiny_model_path, tmp_path / "sql", rank=8, targets=["q_proj", "v_proj"])
    keys = KeyMaker(load_tokenizer(tiny_model_path), 8)
    with start_server(tiny_model_path, block_size=8, enable_lora=True, max_lora_rank=16,
                      lora_modules=[LoRAModuleSpec("sql", str(adapter))]) as (url, _):
        base_id = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        view = EngineView(url)
        with httpx.Client(base_url=url, timeout=60) as client:
            for salt in (None, "tenant-a"):
                predicted = {}
                for model in ("sql", base_id):
                    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                            **({"cache_salt": salt} if salt else {})}
                    key = keys.make("/v1/completions", json.dumps(body).encode(), {}, adapters={"sql"})
                    assert key is not None and len(key.hashes) >= 3
                    first = client.post("/v1/completions", json=body)
                    assert first.status_code == 200, first.text
                    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no sharing
                    view.apply(client.get("/kv/blocks", params={} if view.seq is None else {"since": view.seq}).json())
                    assert view.matched_blocks(key.hashes, 0.0) == len(key.hashes)
                    again = client.post("/v1/completions", json=body).json()["usage"]
                    assert again["prompt_tokens_details"]["cached_tokens"] == len(key.hashes) * key.block_size
                    predicted[model] = key
                assert predicted["sql"].adapter == "sql" and predicted[base_id].adapter is None
                assert set(predicted["sql"].hashes).isdisjoint(predicted[base_id].hashes)
