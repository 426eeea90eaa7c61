"""Requests a careless or hostile client sends (issue 28): each is a 200 or an OpenAI-shaped
400/413, the keep-alive connection it came on serves the next request, and the engine lives."""

from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.unit

MODEL = "tiny"
CONTEXT = 128
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(start_server, tiny_model_path):
    with start_server(tiny_model_path, served_model_name=MODEL, max_num_seqs=8, kv_cache_memory=8 * 2**20,
                      max_model_len=CONTEXT, max_body_bytes=BODY_LIMIT) as (url, state):
        yield url, state


class KeepAlive:
    """One HTTP/1.1 connection; `post` fails if the server closed it after the last answer."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=60)
        self.socket = None

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        # json.dumps escapes lone surrogates ("\ud800"), as any JSON client sends them
        self.connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if self.socket is None:
            self.socket = self.connection.sock
        assert self.connection.sock is self.socket, "the server closed the keep-alive connection"
        response = self.connection.getresponse()
        return response.status, json.loads(response.read())


def _assert_openai_error(body: dict) -> dict:
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _assert_alive(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/ready").status_code == 200


# Every body of issue 28's "Why" that stopped the engine loop or answered 500.
CRASHERS = {
    "top_p_1e-46": ("/v1/completions", {"prompt": "hi", "top_p": 1e-46, "temperature": 1.0}),
    "top_p_5e-324": ("/v1/completions", {"prompt": "hi", "top_p": 5e-324, "temperature": 1.0}),
    "temperature_1e-40": ("/v1/completions", {"prompt": "hi", "temperature": 1e-40}),
    "temperature_1e-300": ("/v1/completions", {"prompt": "hi", "temperature": 1e-300}),
    "repetition_penalty_1e-300": ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-300,
                                                      "temperature": 1.0}),
    "repetition_penalty_1e300": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e300, "temperature": 0.7}),
    "seed_2**64": ("/v1/completions", {"prompt": "hi", "seed": 2**64, "temperature": 0.5}),
    "top_k_10**30": ("/v1/completions", {"prompt": "hi", "top_k": 10**30, "temperature": 1.0}),
    "surrogate_prompt": ("/v1/completions", {"prompt": "\ud800"}),
    "surrogate_prompt_list": ("/v1/completions", {"prompt": ["fine", "x\ud800"]}),
    "surrogate_chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}),
    "surrogate_tokenize": ("/tokenize", {"prompt": "a\udfffb"}),
    "surrogate_model": ("/v1/completions", {"prompt": "hi", "model": "\ud800"}),
    "template_add_generation_prompt": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}}),
    "template_messages": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}),
    "template_reserved_names": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"self": 1, "source": 2}}),
}


@pytest.mark.parametrize("name", list(CRASHERS))
def test_each_crasher_is_answered_and_the_connection_and_engine_live_on(server, name) -> None:
    url, _ = server
    path, body = CRASHERS[name]
    connection = KeepAlive(url)
    status, answer = connection.post(path, {**body, "max_tokens": 4} if "v1" in path else body)
    assert status in (200, 400), answer
    if status == 400:
        assert _assert_openai_error(answer)["type"] == "invalid_request_error"
    assert connection.post("/v1/completions", {"prompt": "plain", "max_tokens": 2})[0] == 200
    _assert_alive(url)


def test_out_of_domain_values_are_400_naming_the_field(server) -> None:
    connection = KeepAlive(server[0])
    for field, value in (("seed", 2**64), ("seed", -2**63 - 1), ("repetition_penalty", 0.0),
                         ("temperature", -1e-300), ("top_p", 0.0), ("min_p", 1.5)):
        status, answer = connection.post("/v1/completions", {"prompt": "hi", field: value})
        assert status == 400 and _assert_openai_error(answer)["param"] == field, (field, answer)
    # JSON's NaN/Infinity extensions are not numbers OpenAI accepts
    raw = '{"prompt": "hi", "temperature": NaN}'
    response = httpx.post(server[0] + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and _assert_openai_error(response.json())["param"] == "temperature"


def test_surrogates_are_refused_naming_the_field(server) -> None:
    status, answer = KeepAlive(server[0]).post("/v1/chat/completions",
                                               {"messages": [{"role": "user", "content": "ok"},
                                                             {"role": "user", "content": "\ud800"}]})
    assert status == 400 and _assert_openai_error(answer)["param"] == "messages.1.content"
    # a surrogate pair is a valid character and is served
    status, _ = KeepAlive(server[0]).post("/v1/completions", {"prompt": "\ud83d\ude00", "max_tokens": 1})
    assert status == 200


def test_tiny_temperature_is_greedy_and_template_kwargs_are_honoured(server) -> None:
    connection = KeepAlive(server[0])
    base = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    greedy = connection.post("/v1/completions", {**base, "temperature": 0})[1]["choices"][0]["text"]
    tiny = connection.post("/v1/completions", {**base, "temperature": 1e-40, "seed": 1})[1]["choices"][0]["text"]
    narrow = connection.post("/v1/completions", {**base, "top_p": 1e-46, "seed": 1})[1]["choices"][0]["text"]
    assert tiny == greedy == narrow  # top_p that small keeps exactly the most likely token
    messages = [{"role": "user", "content": "hi"}]
    prompts = [connection.post("/tokenize", {"messages": messages, "add_generation_prompt": flag})[1]["count"]
               for flag in (True, False)]
    status, answer = connection.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert status == 200 and answer["usage"]["prompt_tokens"] == prompts[1] < prompts[0]
    status, answer = connection.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "chat_template_kwargs": {"messages": []}})
    assert status == 400 and _assert_openai_error(answer)["param"] == "chat_template_kwargs.messages"


def test_a_body_over_the_limit_is_413_as_it_streams_in_and_probes_stay_fast(server) -> None:
    url, _ = server
    ten_mb = b'{"prompt": "' + b"fox " * (10 * 2**20 // 4) + b'"}'
    # declared length: refused before a byte of the body is read
    response = httpx.post(url + "/v1/completions", content=ten_mb, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "limit" in _assert_openai_error(response.json())["message"]
    # chunked upload: refused once the limit streams past, while /health keeps answering
    slowest_probe, stop = [0.0], threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            slowest_probe[0] = max(slowest_probe[0], time.monotonic() - start)
            time.sleep(0.02)

    def chunks():
        for offset in range(0, len(ten_mb), 64 * 1024):
            yield ten_mb[offset:offset + 64 * 1024]

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    start = time.monotonic()
    try:
        response = httpx.post(url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                              timeout=30)
    finally:
        elapsed = time.monotonic() - start
        stop.set()
        prober.join(10)
    assert response.status_code == 413 and elapsed < 5, elapsed
    assert slowest_probe[0] < 1.0, slowest_probe
    # under the limit but too long for the context: refused with the context error, not parsed into tokens
    status, answer = KeepAlive(url).post("/v1/completions", {"prompt": "fox " * 12000})
    assert status == 400 and _assert_openai_error(answer)["code"] == "context_length_exceeded"


def test_a_2000_prompt_batch_is_served_whole_and_a_bigger_one_is_400(server) -> None:
    url, state = server
    assert state.admission.max_queued < 2000  # admitted as one unit onto the idle queue
    prompts = [f"item {i}" for i in range(2000)]
    response = httpx.post(url + "/v1/completions", json={"prompt": prompts, "max_tokens": 1}, timeout=600)
    assert response.status_code == 200, response.text[:300]
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(2000))
    response = httpx.post(url + "/v1/completions", json={"prompt": ["x"] * 2049, "max_tokens": 1})
    error = _assert_openai_error(response.json())
    assert response.status_code == 400 and error["param"] == "prompt" and "2048" in error["message"]
    _assert_alive(url)


def test_free_blocks_gauge_sits_beside_the_evictable_count(server) -> None:
    url, _ = server
    httpx.post(url + "/v1/completions", json={"prompt": "cache me " * 10, "max_tokens": 1})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    free, evictable = families["kubeinfer:kv_cache_blocks_free"], families["kubeinfer:kv_cache_blocks_evictable"]
    assert "evictable" in free.documentation
    total = families["kubeinfer:kv_cache_blocks_total"].samples[0].value
    assert evictable.samples[0].value >= 1  # the prompt's full blocks stay cached after it finished
    assert free.samples[0].value + evictable.samples[0].value == total  # nothing else runs
