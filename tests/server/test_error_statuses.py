"""Every error status the server answers, with OpenAI's JSON body, on the real engine."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.unit

MODEL = "tiny"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_path):
    with start_server(tiny_model_path, served_model_name=MODEL, api_keys=[KEY], max_num_seqs=4,
                      kv_cache_memory=4 * 2**20, max_model_len=64) as (url, state):
        yield url, state


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=60)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_401_without_or_with_a_wrong_key(server) -> None:
    for key in (None, "sk-wrong"):
        error = _error(_post(server, "/v1/completions", {"prompt": "hi"}, key=key), 401)
        assert error["code"] == "invalid_api_key" and "sk-wrong" not in error["message"]
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_probes_and_metrics_need_no_key(server) -> None:
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(server[0] + path).status_code == 200


def test_400_on_bad_parameters(server) -> None:
    error = _error(_post(server, "/v1/completions", {"prompt": "hi", "temperature": -1}), 400)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    error = _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert error["param"].startswith("messages")
    # the engine's own validation (min_tokens > max_tokens) also comes back as 400
    error = _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}), 400)
    assert "min_tokens" in error["message"]
    error = _error(_post(server, "/v1/completions", {"prompt": [999999]}), 400)
    assert "999999" in error["message"]


def test_400_on_context_overflow(server) -> None:
    error = _error(_post(server, "/v1/completions", {"prompt": "fox " * 100, "max_tokens": 4}), 400)
    assert error["code"] == "context_length_exceeded" and "maximum context length is 64" in error["message"]
    error = _error(_post(server, "/v1/completions", {"prompt": "fox", "max_tokens": 64}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox " * 100}])


def test_404_on_unknown_model_and_route(server) -> None:
    error = _error(_post(server, "/v1/completions", {"model": "gpt-5", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    _error(httpx.get(server[0] + "/v1/nothing-here"), 404)


def test_503_with_retry_after_while_draining(server) -> None:
    url, state = server
    state.admission.draining = True
    try:
        response = _post(server, "/v1/completions", {"prompt": "hi"})
        assert _error(response, 503)["code"] == "draining" and response.headers["retry-after"]
        assert _error(httpx.get(url + "/ready"), 503)["code"] == "draining"
        assert httpx.get(url + "/health").status_code == 200  # alive, just not taking work
    finally:
        state.admission.draining = False
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_health_fails_once_the_engine_loop_stops(start_server, tiny_model_path) -> None:
    import asyncio

    with start_server(tiny_model_path, kv_cache_memory=2**20, max_model_len=64) as (url, state):
        assert httpx.get(url + "/health").status_code == 200
        asyncio.run(state.engine.shutdown())
        error = _error(httpx.get(url + "/health"), 503)
        assert error["message"] == "engine loop is not running"
