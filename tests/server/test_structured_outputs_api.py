"""Structured outputs and tool calling through the official openai client against the server
on the embedded SmolLM2-135M-Instruct: parse() with pydantic models, JSON mode, regex and choice
at temperature 1, forced tool calls streamed and not, a tool-result turn, OpenAI-shaped 400s,
a mixed batch whose free rows are untouched, and a grammar fault that fails one request only."""

from __future__ import annotations

import asyncio
import json
import re
from enum import Enum
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kubeinfer.server.engine.structured_output import GrammarProcessor

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(start_server):
    with start_server("embedded", max_num_seqs=32, kv_cache_memory=256 * 2**20) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: float = Field(ge=0, le=40)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    favourite_color: Color
    nickname: str | None = Field(max_length=12)


class Stop(BaseModel):
    city: str = Field(max_length=16)
    nights: int = Field(ge=1, le=14)


class Trip(BaseModel):
    traveller: str = Field(max_length=16)
    stops: list[Stop] = Field(max_length=2)


@pytest.mark.parametrize("schema, question", [
    (City, "Describe Paris as JSON."),
    (Pet, "Describe a pet as JSON."),
    (Trip, "Plan a short trip through two European cities as JSON."),
])
def test_parse_returns_the_pydantic_object(client, model, schema, question) -> None:
    completion = client.chat.completions.parse(model=model, messages=_ask(question), response_format=schema,
                                               max_tokens=160, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, schema)
    assert schema.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_valid_json(client, model) -> None:
    completion = client.chat.completions.create(
        model=model, messages=_ask('Return a JSON object with the keys "city" and "country" for Paris.'),
        response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_regex_holds_on_50_samples_at_temperature_one(client, model) -> None:
    pattern = r"(red|green|blue)-[0-9]{2}"
    completion = client.completions.create(model=model, prompt="A color and a number:", n=50, max_tokens=12,
                                           temperature=1.0, extra_body={"structured_outputs": {"regex": pattern}})
    texts = [choice.text for choice in completion.choices]
    assert len(texts) == 50 and all(re.fullmatch(pattern, text) for text in texts), texts
    assert len(set(texts)) > 1  # really sampled


def test_choice_holds_on_50_samples_at_temperature_one(client, model) -> None:
    options = ["positive", "negative", "neutral"]
    completion = client.chat.completions.create(
        model=model, messages=_ask("Classify the sentiment of: I love this film."), n=50, max_tokens=8,
        temperature=1.0, extra_body={"guided_choice": options})
    answers = [choice.message.content for choice in completion.choices]
    assert len(answers) == 50 and set(answers) <= set(options), answers


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 20}}}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


def _assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_streamed_and_not(client, model, tool_choice) -> None:
    names = {"get_time"} if isinstance(tool_choice, dict) else {"get_weather", "get_time"}
    kwargs = dict(model=model, messages=_ask("What is the weather in Paris right now?"), tools=[WEATHER, TIME],
                  tool_choice=tool_choice, max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls(whole.choices[0].message.tool_calls, names)
    with client.chat.completions.stream(**kwargs) as stream:  # the SDK assembles delta.tool_calls
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    _assert_valid_calls(streamed.choices[0].message.tool_calls, names)
    assert [c.function.arguments for c in streamed.choices[0].message.tool_calls] == \
        [c.function.arguments for c in whole.choices[0].message.tool_calls]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # incremental, as vLLM streams them: id, type and name first, then arguments as generated
    entries = [(chunk.choices[0].finish_reason, call) for chunk in chunks if chunk.choices
               for call in chunk.choices[0].delta.tool_calls or []]
    first = entries[0][1]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function" and first.function.name
    pieces = [(finish, call.function.arguments) for finish, call in entries
              if call.index == 0 and call.function.arguments]
    assert len([piece for finish, piece in pieces if finish is None]) >= 3, pieces  # before the last chunk
    assert "".join(piece for _, piece in pieces) == whole.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_tool_result_turn_is_answered(client, model) -> None:
    first = client.chat.completions.create(
        model=model, messages=_ask("What is the weather in Paris?"), tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = _ask("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=40,
                                            temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and the result are in it
    none = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls in (None, []) and none.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "response_format", "unsupported"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "tool_choice", "'launch', which is not in 'tools'"),
    # SmolLM2's vocabulary has no token for U+0016 (schemathesis found the 500 it used to give)
    ({"guided_choice": ["\x16"]}, "guided_choice", "no token of this model's vocabulary can begin it"),
    # ... nor any choice it could start but not finish
    ({"guided_choice": ["yes", "a\x16"]}, "guided_choice", "'a\\x16' cannot be written with this model's vocabulary"),
])
def test_bad_constraints_are_openai_400s(server, body, param, words) -> None:
    response = httpx.post(server[0] + "/v1/chat/completions", timeout=120,
                          json={"messages": _ask("hi"), "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]


def test_a_constraint_the_vocabulary_cannot_finish_is_the_clients_error(server, model) -> None:
    """SmolLM2 writes the 'a' of the regex 'a\\x16' but has no token for U+0016: the request ends
    with OpenAI's 400 (an error frame once streaming), never a 500, and the server goes on."""
    url = server[0]
    body = {"model": model, "prompt": "Say a.", "max_tokens": 8, "temperature": 0, "guided_regex": "a\x16"}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "cannot be completed" in error["message"]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as streamed:
        assert streamed.status_code == 200
        frames = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["error"]["type"] == "invalid_request_error"
    ok = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200


def test_mixed_batch_keeps_free_rows_token_identical(server, model) -> None:
    """32 concurrent requests, half constrained by different schemas: every constrained output
    validates and the free ones equal a run without the constrained neighbours (greedy)."""
    schemas = [{"type": "object", "additionalProperties": False, "required": [key],
                "properties": {key: kind}}
               for key, kind in [("n", {"type": "integer", "minimum": 0, "maximum": 99}),
                                 ("ok", {"type": "boolean"}),
                                 ("color", {"enum": ["red", "green"]}),
                                 ("xs", {"type": "array", "items": {"type": "integer"}, "maxItems": 3})]]
    free = [f"Write one sentence about the number {i}." for i in range(16)]
    constrained = [(f"Give JSON for item {i}.", schemas[i % 4]) for i in range(16)]

    async def free_one(aclient: openai.AsyncOpenAI, prompt: str):
        return await aclient.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                                logprobs=0)

    async def constrained_one(aclient: openai.AsyncOpenAI, prompt: str, schema: dict):
        return await aclient.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                                extra_body={"guided_json": schema})

    async def run(with_neighbours: bool):
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0,
                                      timeout=600) as aclient:
            jobs = [free_one(aclient, p) for p in free]
            if with_neighbours:
                jobs += [constrained_one(aclient, p, s) for p, s in constrained]
            return await asyncio.gather(*jobs)

    alone = asyncio.run(run(False))
    mixed = asyncio.run(run(True))
    for a, b in zip(alone, mixed[:16]):
        assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    for result, (_, schema) in zip(mixed[16:], constrained):
        assert result.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(result.choices[0].text), schema)


def test_a_failing_grammar_fails_only_its_request(server, model, monkeypatch) -> None:
    """Fault injection: the matcher of one request raises mid-generation; that request gets
    OpenAI's error, its blocks are freed, and the requests beside it finish normally."""
    url, state = server
    accept = GrammarProcessor.accept
    calls = {"n": 0}

    def flaky(self, token_id: int) -> None:
        if not hasattr(self, "doomed"):
            calls["n"] += 1
            self.doomed = calls["n"] == 1  # the first matcher that accepts a token is the victim
        if self.doomed:
            raise RuntimeError("injected matcher fault")
        accept(self, token_id)

    monkeypatch.setattr(GrammarProcessor, "accept", flaky)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}

    async def one(aclient: openai.AsyncOpenAI, i: int):
        extra = {"guided_json": schema} if i < 3 else {}
        return await aclient.completions.create(model=model, prompt=f"Item {i}:", max_tokens=16, temperature=0,
                                                extra_body=extra)

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(6)), return_exceptions=True)

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, Exception)]
    assert len(failed) == 1 and isinstance(failed[0], openai.InternalServerError), results
    assert failed[0].body["code"] == "request_failed"
    for result in results:
        if not isinstance(result, Exception):
            assert result.choices[0].finish_reason in ("stop", "length")
    monkeypatch.undo()
    engine = state.engine.engine
    deadline = asyncio.run(_settle(state))
    assert deadline and engine.stats().kv_cache_usage == 0.0
    again = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600).completions.create(
        model=model, prompt="Item 9:", max_tokens=16, temperature=0, extra_body={"guided_json": schema})
    assert json.loads(again.choices[0].text)["a"] in range(10)


async def _settle(state, seconds: float = 30.0) -> bool:
    """Wait until the engine holds no request (the failed one is dropped between steps)."""
    for _ in range(int(seconds / 0.1)):
        if not state.engine.engine.requests:
            return True
        await asyncio.sleep(0.1)
    return False
