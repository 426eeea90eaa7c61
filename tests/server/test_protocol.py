"""Request validation and the OpenAI error JSON, without an engine."""

from __future__ import annotations

import httpx
import pytest
from fastapi import Depends, FastAPI
from pydantic import ValidationError

from kubeinfer.server.api.auth import ApiKeyCheck
from kubeinfer.server.api.errors import install_error_handlers
from kubeinfer.server.api.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kubeinfer.server.api.sampling import sampling_params
from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams
from kubeinfer.server.engine.validation import check_fits

pytestmark = pytest.mark.unit


def _app(keys: list[str]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions", dependencies=[Depends(ApiKeyCheck(keys))])
    async def completions(body: CompletionRequest) -> dict:
        if body.prompt == "engine says no":
            raise InvalidRequestError("temperature must be non-negative")
        if body.prompt == "crash":
            raise RuntimeError("secret internal detail")
        return {"ok": True}

    return app


async def _post(app: FastAPI, json: object | None = None, content: bytes | None = None,
                headers: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/completions", json=json, content=content, headers=headers)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_validation_error_is_400_in_openai_shape() -> None:
    response = await _post(_app([]), {"prompt": "hi", "n": 0})
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] == "n"
    assert error["message"].startswith("n: ")


async def test_union_type_errors_name_the_field_not_the_member() -> None:
    error = _error(await _post(_app([]), {"prompt": [["a"]]}))
    assert error["param"] == "prompt" and error["message"] == "prompt: value has none of the accepted types"


async def test_missing_field_and_bad_json_are_400() -> None:
    assert _error(await _post(_app([]), {"model": "x"}))["param"] == "prompt"
    response = await _post(_app([]), content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in _error(response)["message"]


async def test_engine_rejection_is_400_and_crash_is_500_without_details() -> None:
    response = await _post(_app([]), {"prompt": "engine says no"})
    assert response.status_code == 400 and "temperature" in _error(response)["message"]
    response = await _post(_app([]), {"prompt": "crash"})
    assert response.status_code == 500
    assert _error(response)["message"] == "internal server error"
    assert "secret" not in response.text


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
async def test_bad_or_missing_key_is_401(headers: dict | None) -> None:
    response = await _post(_app(["k1", "k2"]), {"prompt": "hi"}, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = _error(response)
    assert error["code"] == "invalid_api_key" and "wrong" not in error["message"]


async def test_any_configured_key_is_accepted() -> None:
    response = await _post(_app(["k1", "k2"]), {"prompt": "hi"}, headers={"Authorization": "Bearer k2"})
    assert response.status_code == 200


def test_unsupported_features_are_refused() -> None:
    for bad in ({"prompt": "x", "suffix": "y"}, {"prompt": "x", "best_of": 3}, {"prompt": ""},
                {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "logprobs": 21},
                {"prompt": "x", "prompt_logprobs": 21}, {"prompt": "x", "prompt_logprobs": 1, "stream": True}):
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)
    user = [{"role": "user", "content": "hi"}]
    for bad in ({"top_logprobs": 2}, {"tools": [{"type": "function"}]},
                {"tool_choice": "sometimes"}, {"messages": []}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**{"messages": user, **bad})
    with pytest.raises(ValidationError):
        TokenizeRequest(prompt="a", messages=user)


def test_chat_content_parts_are_joined_for_the_template() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert request.messages[0].to_template() == {"role": "user", "content": "a\nb"}


def test_only_fields_the_client_set_override_model_defaults() -> None:
    request = CompletionRequest(prompt="x", top_p=0.5, stop="END", extra_field="ignored")
    params = sampling_params(request, max_tokens=7, logprobs=None)
    assert "top_p" in params.explicit_fields and "temperature" not in params.explicit_fields
    assert params.top_p == 0.5 and params.stop == ["END"] and params.max_tokens == 7
    merged = params.with_defaults({"temperature": 0.2, "top_p": 0.9})
    assert merged.temperature == 0.2 and merged.top_p == 0.5


def test_context_overflow_names_the_numbers() -> None:
    check_fits(10, SamplingParams(max_tokens=6), 16, 100)
    with pytest.raises(InvalidRequestError) as info:
        check_fits(10, SamplingParams(max_tokens=7), 16, 100)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert "maximum context length is 16" in str(info.value) and "17" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        check_fits(16, SamplingParams(max_tokens=None), 16, 100, "messages")
    assert info.value.param == "messages"


async def test_the_default_body_limit_is_sized_to_the_context() -> None:
    from types import SimpleNamespace

    from kubeinfer.server.api.app import build_app

    state = SimpleNamespace(engine=SimpleNamespace(max_model_len=32768))  # 64 B a token: 2 MiB
    transport = httpx.ASGITransport(app=build_app(state, []), raise_app_exceptions=False)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for size, refused in ((2**21 - 64, False), (2**21 + 1, True)):
            body = b'{"prompt": "' + b"a" * (size - 14) + b'"}'
            response = await client.post("/tokenize", content=body, headers={"content-type": "application/json"})
            assert (response.status_code == 413) == refused, (size, response.status_code)
    assert response.json()["error"]["message"].startswith("request body is larger than the limit of 2097152")
