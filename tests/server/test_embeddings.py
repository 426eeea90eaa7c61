"""/v1/embeddings on a live server (`--task embed`): the official openai client, OpenAI's input
forms and encodings, matryoshka `dimensions`, the 400s a vLLM user expects, and metrics.

The model is a tiny random Qwen3 embedder with sentence-transformers files (last token,
normalised) and `matryoshka_dimensions`; every vector is checked against transformers' hidden
states pooled by hand (cosine >= 0.9999, max |diff| <= 1e-5).
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from helpers.embedding_models import build_embedding_model, reference_embedding

pytestmark = pytest.mark.integration

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world!",
         "Kubernetes schedules pods; the engine batches tokens; the cache shares prefixes. " * 2]
ATOL = 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, start_server):
    path, decoder = build_embedding_model(tmp_path_factory.mktemp("embed"), kind="qwen3", pooling="last",
                                          matryoshka_dimensions=[64, 32])
    with start_server(str(path), task="embed", max_num_batched_tokens=32, served_model_name="tiny-embed") as (url, state):
        yield url, state, decoder


def _close(vector, expected: torch.Tensor) -> None:
    got = torch.tensor(vector, dtype=torch.float32)
    assert got.shape == expected.shape
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) >= 0.9999
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _ids(state, text: str) -> list[int]:
    return state.engine.tokenizer.encode(text, add_special_tokens=True)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_openai_client_embeddings_create(embedder):
    """The client asks for base64 unless told otherwise and decodes float32 itself."""
    import openai

    url, state, decoder = embedder
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    result = client.embeddings.create(model="tiny-embed", input=TEXTS)
    assert [item.index for item in result.data] == [0, 1, 2]
    for text, item in zip(TEXTS, result.data):
        _close(item.embedding, reference_embedding(decoder, _ids(state, text)))
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(_ids(state, t)) for t in TEXTS)
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS[1], encoding_format="float")
    _close(floats.data[0].embedding, reference_embedding(decoder, _ids(state, TEXTS[1])))
    assert state.engine.stats().kv_cache_usage == 0


@pytest.mark.parametrize("form", ["string", "strings", "token_ids", "token_id_lists"])
def test_input_forms(embedder, form):
    url, state, decoder = embedder
    ids = [_ids(state, text) for text in TEXTS]
    given, expected_ids = {"string": (TEXTS[0], ids[:1]), "strings": (TEXTS, ids),
                           "token_ids": (ids[2], ids[2:]), "token_id_lists": (ids, ids)}[form]
    body = httpx.post(f"{url}/v1/embeddings", json={"input": given}, timeout=60).json()
    assert body["object"] == "list" and body["model"] == "tiny-embed" and body["id"].startswith("embd-")
    assert [item["object"] for item in body["data"]] == ["embedding"] * len(expected_ids)
    for item, prompt in zip(body["data"], expected_ids):
        _close(item["embedding"], reference_embedding(decoder, prompt))
    assert body["usage"]["prompt_tokens"] == sum(map(len, expected_ids))


def test_base64_is_little_endian_float32(embedder):
    url, state, decoder = embedder
    body = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=60).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    _close(vector.tolist(), reference_embedding(decoder, _ids(state, TEXTS[0])))


def test_matryoshka_dimensions(embedder):
    url, state, decoder = embedder
    body = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "dimensions": 32}, timeout=60).json()
    _close(body["data"][0]["embedding"], reference_embedding(decoder, _ids(state, TEXTS[0]), dimensions=32))
    error = _error(httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0], "dimensions": 20}, timeout=60), 400)
    assert error["param"] == "dimensions" and "only supports [64, 32] matryoshka dimensions" in error["message"]


@pytest.mark.parametrize("given,message", [
    ([], "'input' must not be empty"), ("", "'input' must not be empty"),
    (["a", ""], "must not contain empty strings"), ([[1, 2], []], "must not contain empty"),
    ([5, 10_000], "out of vocabulary"), ({"text": "a"}, "none of the accepted types")])
def test_bad_input_is_a_400(embedder, given, message):
    url, state, _ = embedder
    error = _error(httpx.post(f"{url}/v1/embeddings", json={"input": given}, timeout=60), 400)
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert state.engine.stats().num_waiting == 0


def test_too_long_input_is_a_400_naming_the_limit(embedder):
    url, state, _ = embedder
    limit = state.engine.max_model_len
    error = _error(httpx.post(f"{url}/v1/embeddings", json={"input": [[5] * (limit + 1)]}, timeout=60), 400)
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens. However, you requested {limit + 1} tokens in the input " \
           "for embedding generation" in error["message"]


def test_generation_routes_are_refused_on_an_embedding_model(embedder):
    url, _, _ = embedder
    chat = _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                             timeout=60), 400)
    assert chat["message"].startswith("The model does not support Chat Completions API (it serves embeddings")
    completion = _error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60), 400)
    assert completion["message"].startswith("The model does not support Completions API")
    assert _error(httpx.post(f"{url}/v1/embeddings", json={"input": "a", "model": "other"}, timeout=60),
                  404)["code"] == "model_not_found"


def test_metrics_count_embedding_requests(embedder):
    url, _, _ = embedder

    def sample(name: str) -> float:
        for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    success = 'vllm:request_success_total{finished_reason="stop",model_name="tiny-embed"}'
    before = sample(success), sample("vllm:prompt_tokens_total"), sample("vllm:e2e_request_latency_seconds_count")
    body = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
    after = sample(success), sample("vllm:prompt_tokens_total"), sample("vllm:e2e_request_latency_seconds_count")
    assert after[0] - before[0] == 3 and after[2] - before[2] == 3
    assert after[1] - before[1] == body["usage"]["prompt_tokens"]
    assert sample("vllm:generation_tokens_total") == 0


def test_embeddings_on_a_generation_model_is_a_400(tiny_model_path, start_server):
    with start_server(tiny_model_path) as (url, state):
        assert state.engine.task == "generate"
        error = _error(httpx.post(f"{url}/v1/embeddings", json={"input": "hello"}, timeout=60), 400)
        assert error["message"].startswith("The model does not support Embeddings API (it serves text generation")


def test_fuzzed_embedding_requests_get_no_5xx(embedder):
    """schemathesis on /v1/embeddings of the embedding server: bodies that follow the schema and
    bodies that break it (values not narrowed); no 5xx, and no request or block left behind."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    url, state, _ = embedder
    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(method="POST", path="/v1/embeddings")
    cases = st.one_of(schema.as_strategy(generation_mode=mode)
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def send(case) -> None:
        response = case.call(base_url=url, timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.body!r:.300}: {response.text[:300]}"

    send()
    print(f"schemathesis /v1/embeddings: statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0
    stats = state.engine.stats()
    assert stats.kv_cache_usage == 0 and stats.num_running == stats.num_waiting == 0 and state.engine.is_alive()
