"""vLLM's LoRA API on a live server over a tiny Llama: adapters as `model`, /v1/models with
`parent`, runtime load/unload (bodies, texts and statuses as vLLM's), the errors of a bad
adapter, the API key, and the LoRA metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest
from helpers.lora_adapters import make_peft_adapter
from helpers.tiny_models import build_tiny_llama, build_tiny_qwen2

from kubeinfer.server.flags import LoRAModuleSpec

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(base path, {name: adapter path}) plus a rank-32 one and one of another base model."""
    root = tmp_path_factory.mktemp("lora-api")
    base, _ = build_tiny_llama(root / "base")
    paths = {name: make_peft_adapter(base, root / name, rank=rank, targets=targets, seed=seed)[0]
             for name, rank, targets, seed in [("sql", 8, ["q_proj", "v_proj"], 1),
                                               ("chat", 16, ["o_proj", "down_proj"], 2),
                                               ("code", 8, ["gate_proj", "up_proj", "k_proj"], 3),
                                               ("big", 32, ["q_proj"], 4)]}
    other, _ = build_tiny_qwen2(root / "other-base", num_kv_heads=1)
    paths["other"] = make_peft_adapter(other, root / "other", rank=8, targets=["k_proj"], seed=5)[0]
    return base, paths


@contextlib.contextmanager
def lora_server(serve_in_thread, base, modules, *, api_keys=None, runtime=True, **engine_kwargs) -> Iterator[str]:
    """A live server over `base` with --enable-lora (`serve_in_thread`: the live_server fixture)."""
    from kubeinfer.server.api.app import build_app
    from kubeinfer.server.api.state import ServerState
    from kubeinfer.server.engine.async_engine import AsyncEngine
    from kubeinfer.server.engine.config import EngineConfig

    config = EngineConfig(model=str(base), dtype="float32", device="cpu", kv_cache_memory=4 << 20,
                          enable_lora=True, lora_modules=modules, max_lora_rank=16, **engine_kwargs)
    engine = AsyncEngine.from_config(config)
    try:
        state = ServerState.create(engine, str(base), 64)
        with serve_in_thread(build_app(state, api_keys or [], runtime_lora_updating=runtime)) as url:
            yield url
    finally:
        asyncio.run(engine.shutdown())


def _complete(url: str, model: str, **headers) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                      "temperature": 0}, headers=headers, timeout=60)


def test_adapters_are_models_listed_with_their_parent(live_server, adapters):
    base, paths = adapters
    with lora_server(live_server, base, [LoRAModuleSpec("sql", str(paths["sql"])), LoRAModuleSpec("chat", str(paths["chat"]))],
                     max_loras=2) as url:
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        base_id = cards[0]["id"]
        assert cards[0]["parent"] is None
        assert [(c["id"], c["root"], c["parent"]) for c in cards[1:]] == [
            ("sql", str(paths["sql"]), base_id), ("chat", str(paths["chat"]), base_id)]
        assert httpx.get(f"{url}/v1/models/sql").json()["parent"] == base_id
        texts = {}
        for model in (base_id, "sql", "chat"):
            response = _complete(url, model)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
            texts[model] = response.json()["choices"][0]["text"]
        assert len(set(texts.values())) == 3   # each adapter changes the answer
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
        assert chat.status_code == 200 and chat.json()["model"] == "chat"
        missing = _complete(url, "nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kubeinfer:lora_requests_total{{adapter="sql",model_name="{base_id}"}} 1.0' in metrics
        info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]


def test_load_and_unload_at_runtime(live_server, adapters):
    base, paths = adapters
    with lora_server(live_server, base, [], max_loras=1) as url:
        load = lambda body: httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)  # noqa: E731
        unload = lambda body: httpx.post(f"{url}/v1/unload_lora_adapter", json=body, timeout=60)  # noqa: E731
        assert _complete(url, "sql").status_code == 404
        response = load({"lora_name": "sql", "lora_path": str(paths["sql"])})
        assert response.status_code == 200
        assert response.text == "Success: LoRA adapter 'sql' added successfully."
        assert load({"lora_name": "code", "lora_path": str(paths["code"])}).status_code == 200
        assert [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]][1:] == ["sql", "code"]
        # one device slot, two adapters: requests take turns in the slot
        for model in ("sql", "code", "sql"):
            assert _complete(url, model).status_code == 200
        again = load({"lora_name": "sql", "lora_path": str(paths["sql"])})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        assert load({"lora_name": "x"}).json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
        response = unload({"lora_name": "sql"})
        assert response.status_code == 200
        assert response.text == "Success: LoRA adapter 'sql' removed successfully."
        assert _complete(url, "sql").status_code == 404
        gone = unload({"lora_name": "sql"})
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."
        assert _complete(url, "code").status_code == 200


@pytest.mark.parametrize(("name", "expected"), [
    ("big", "rank 32 of model.layers.0.self_attn.q_proj is above --max-lora-rank 16"),
    ("other", "an adapter of another base model"),
    ("missing", "lora_path holds no readable PEFT adapter"),   # nothing said about the filesystem
])
def test_bad_adapters_are_refused_with_400_naming_the_problem(live_server, adapters, tmp_path, name, expected):
    base, paths = adapters
    path = paths.get(name, tmp_path / "nowhere")
    with lora_server(live_server, base, []) as url:
        response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert response.status_code == 400
        assert expected in response.json()["error"]["message"]
        assert name in response.json()["error"]["message"]
        assert [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]][1:] == []


def test_adapter_files_missing_or_foreign_target(live_server, adapters, tmp_path):
    base, paths = adapters
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text((paths["sql"] / "adapter_config.json").read_text())
    import torch
    from safetensors.torch import save_file
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(384, 8)}, str(foreign / "adapter_model.safetensors"))
    with lora_server(live_server, base, []) as url:
        for path, expected in ((empty, "lora_path holds no readable PEFT adapter"),
                               (foreign, "target module lm_head is not supported")):
            response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
            assert response.status_code == 400 and expected in response.json()["error"]["message"], response.text


def test_an_adapter_loaded_again_under_a_used_name_finds_nothing_of_the_old_one_cached(live_server, adapters):
    """The prefix cache's namespace is the adapter's name: loading other weights under a name
    must drop the K/V the previous adapter of that name left, or its blocks would be reused."""
    base, paths = adapters
    long_prompt = (PROMPT * 5)[:40]   # two full blocks of 16

    def complete(url: str, model: str) -> dict:
        response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": long_prompt,
                                                               "max_tokens": 6, "temperature": 0}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def cached(answer: dict) -> int:
        return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    load = lambda name, path: httpx.post(f"{url}/v1/load_lora_adapter",  # noqa: E731
                                         json={"lora_name": name, "lora_path": str(path)}, timeout=60)
    with lora_server(live_server, base, [], max_loras=2) as url:
        assert load("x", paths["sql"]).status_code == 200
        complete(url, "x")
        assert cached(complete(url, "x")) == 32   # the old adapter's blocks are cached
        assert load("chat", paths["chat"]).status_code == 200
        expected = complete(url, "chat")["choices"][0]["text"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=60).status_code == 200
        assert load("x", paths["chat"]).status_code == 200
        answer = complete(url, "x")
        assert cached(answer) == 0 and answer["choices"][0]["text"] == expected


def test_startup_error_names_the_adapter(adapters):
    from kubeinfer.server.engine.llm_engine import LLMEngine
    from kubeinfer.server.engine.config import EngineConfig

    base, paths = adapters
    with pytest.raises(ValueError, match="--lora-modules big=.*rank 32"):
        LLMEngine(EngineConfig(model=str(base), dtype="float32", device="cpu", kv_cache_memory=4 << 20,
                               enable_lora=True, lora_modules=[LoRAModuleSpec("big", str(paths["big"]))]))


def test_runtime_routes_off_by_default_and_behind_the_api_key(live_server, adapters):
    base, paths = adapters
    body = {"lora_name": "sql", "lora_path": str(paths["sql"])}
    with lora_server(live_server, base, [], runtime=False) as url:
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 404
    with lora_server(live_server, base, [], api_keys=["k"]) as url:
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
        ok = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


def test_vllm_environment_variable_allows_runtime_updating():
    from kubeinfer.server.api.lora import runtime_updating_allowed

    assert runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_updating_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False"})
    assert runtime_updating_allowed(True, {})


def test_bench_serve_spreads_requests_over_lora_modules(live_server, adapters, tmp_path):
    import argparse

    from kubeinfer.server.bench import serve as bench_serve

    base, paths = adapters
    with lora_server(live_server, base, [LoRAModuleSpec("sql", str(paths["sql"])),
                                         LoRAModuleSpec("chat", str(paths["chat"]))], max_loras=2) as url:
        parser = argparse.ArgumentParser()
        bench_serve.add_arguments(parser)
        out = tmp_path / "bench.json"
        code = bench_serve.run(parser.parse_args([
            "--base-url", url, "--num-prompts", "4", "--output-len", "3", "--input-len", "8", "--token-range", "3,384",
            "--concurrency", "2", "--warmup", "0", "--no-progress", "--json", str(out), "--lora-modules", "sql", "chat"]))
        assert code == 0
        level = json.loads(out.read_text())["levels"][0]
        # (a tiny random model's 3 tokens may decode to no text, which the client counts as an error)
        assert level["completed"] + level["errors"] == 4 and level["completed"] >= 2
        metrics = httpx.get(f"{url}/metrics").text
        counts = {line.split('adapter="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("kubeinfer:lora_requests_total{")}
        assert counts == {"sql": 2.0, "chat": 2.0}
