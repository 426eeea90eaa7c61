"""`echo`, `max_tokens: 0`, `prompt_logprobs`, /tokenize and /detokenize on a tiny random model,
as OpenAI and vLLM shape them; the prompt's logprobs equal transformers' (float32, 1e-4 nats).
A fuzz over the fields' combinations and an injected scoring fault: 200 or a 400 in OpenAI's
format, only the faulted requests fail, and no request or KV block is left behind."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from helpers.tiny_models import load_hf_model
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kubeinfer.server.engine import prompt_logprobs as prompt_logprobs_module

pytestmark = pytest.mark.integration

ATOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog, twice"
FIXED = {"ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_path):
    with start_server(tiny_model_path, served_model_name="tiny", max_num_seqs=8, kv_cache_memory=8 << 20,
                      max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True) as served:
        yield served


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return load_hf_model(tiny_model_path)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _ids(url: str, prompt: str) -> list[int]:
    return _post(url, "/tokenize", {"prompt": prompt}).json()["tokens"]


def _wait_idle_without_leaks(state) -> None:
    import time

    deadline = time.monotonic() + 30
    while True:
        stats = state.engine.stats()
        if (stats.num_running == stats.num_waiting == 0
                and stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server, hf_model) -> None:
    url, _ = server
    ids = _ids(url, PROMPT)
    body = _post(url, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 3}).json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids))]
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    for position in range(1, len(ids)):
        row = reference[position - 1]
        assert abs(logprobs["token_logprobs"][position] - float(row[ids[position]])) < ATOL
        top = logprobs["top_logprobs"][position]
        assert len(top) <= 4 and max(top.values()) == pytest.approx(float(row.max()), abs=ATOL)
    # vLLM's prompt_logprobs ride along: {token id: {logprob, rank, decoded_token}}
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert entries[1][str(ids[1])]["logprob"] == logprobs["token_logprobs"][1]


def test_echo_puts_the_prompt_in_front_of_every_completion(server) -> None:
    url, _ = server
    ids = _ids(url, PROMPT)
    request = {"prompt": PROMPT, "echo": True, "max_tokens": 3, "logprobs": 1, "n": 2, **FIXED}
    whole = _post(url, "/v1/completions", request).json()
    plain = _post(url, "/v1/completions", {**request, "echo": False}).json()
    assert whole["usage"]["completion_tokens"] == 6
    for echoed, alone in zip(whole["choices"], plain["choices"]):
        assert echoed["text"] == PROMPT + alone["text"]
        logprobs = echoed["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 3
        assert logprobs["token_logprobs"][len(ids):] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=ATOL)
        assert logprobs["text_offset"][len(ids)] == len(PROMPT)
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={**request, "n": 1, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    streamed = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"][1:],
                                                                 abs=ATOL)
    echo_only = _post(url, "/v1/completions", {**request, "max_tokens": 0, "stream": True})
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in echo_only.text.splitlines()
             if line.startswith("data: {")]
    assert texts == [PROMPT, PROMPT]   # one chunk per choice, the prompt alone


def test_token_id_prompts_echo_their_decoded_text(server) -> None:
    url, _ = server
    ids = _ids(url, PROMPT)
    body = _post(url, "/v1/completions", {"prompt": [ids, ids[:4]], "echo": True, "max_tokens": 0}).json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [PROMPT, _post(url, "/detokenize", {"tokens": ids[:4]}).json()["prompt"]]
    assert all(c["logprobs"] is None and c["prompt_logprobs"] is None for c in body["choices"])


def test_prompt_logprobs_on_completions_and_chat(server) -> None:
    url, _ = server
    ids = _ids(url, PROMPT)
    choice = _post(url, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, **FIXED}
                   ).json()["choices"][0]
    assert choice["logprobs"] is None and len(choice["prompt_logprobs"]) == len(ids)
    assert all(len(entry) <= 3 and entry[str(token)]["rank"] >= 1
               for entry, token in zip(choice["prompt_logprobs"][1:], ids[1:]))
    messages = [{"role": "user", "content": "Hello there"}]
    chat = _post(url, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 2, **FIXED})
    rendered = _post(url, "/tokenize", {"messages": messages}).json()["tokens"]
    entries = chat.json()["prompt_logprobs"]
    assert len(entries) == len(rendered) and all(list(e) == [str(t)] for e, t in zip(entries[1:], rendered[1:]))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
])
def test_bad_combinations_are_400_in_openai_format(server, body, param) -> None:
    response = _post(server[0], "/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    chat = _post(server[0], "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "prompt_logprobs": 21})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"


def test_tokenize_and_detokenize_round_trip_as_the_tokenizer_does(server) -> None:
    url, state = server
    tokenizer = state.engine.tokenizer
    body = _post(url, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] == 256
    assert _post(url, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": PROMPT}
    assert "token_strs" not in _post(url, "/tokenize", {"prompt": PROMPT}).json()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! How"}]
    text = tokenizer.chat_prompt(messages, False, True, None)
    chat = _post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                    "continue_final_message": True}).json()
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert _post(url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"] == text
    bad = _post(url, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    empty = _post(url, "/tokenize", {"messages": []})   # found by the schema fuzz as a 500
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


FIELDS = st.fixed_dictionaries({}, optional={
    "echo": st.booleans(), "max_tokens": st.sampled_from([0, 1, 3, None, -1]),
    "logprobs": st.sampled_from([None, 0, 1, 5, 20, 21, -1]), "prompt_logprobs": st.sampled_from([None, 0, 2, 20, 21]),
    "n": st.integers(1, 3), "stream": st.booleans(), "ignore_eos": st.just(True)})
PROMPTS = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 600), min_size=1, max_size=40))


@pytest.mark.parametrize("fault", [False, True])
def test_fuzzed_echo_and_prompt_logprobs_leave_nothing_behind(server, monkeypatch, fault) -> None:
    """Every combination is a 200 or a 400 in OpenAI's shape; with scoring faulted, the requests
    that asked for prompt logprobs fail alone (500 with OpenAI's body) while a concurrent plain
    request completes, and the engine lives on without leaked blocks."""
    url, state = server
    if fault:
        def broken(*args, **kwargs):
            raise RuntimeError("injected prompt-logprob fault")
        monkeypatch.setattr(prompt_logprobs_module, "logprob_entries", broken)
    statuses: dict[int, int] = {}

    @settings(max_examples=25, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fields=FIELDS, prompt=PROMPTS)
    def send(fields, prompt) -> None:
        body = {"prompt": prompt, **{k: v for k, v in fields.items() if v is not None}}
        plain: dict = {}
        thread = threading.Thread(target=lambda: plain.update(r=_post(url, "/v1/completions", {
            "prompt": "steady", "max_tokens": 4, **FIXED})))
        thread.start()
        response = _post(url, "/v1/completions", body)
        thread.join(120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert plain["r"].status_code == 200
        scored = body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None)
        if response.status_code == 200 or (fault and scored and response.status_code == 500):
            if response.status_code == 200 and not body.get("stream"):
                assert len(response.json()["choices"]) == body.get("n", 1)
            return
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]

    send()
    assert state.engine.is_alive() and 200 in statuses and 400 in statuses, statuses
    _wait_idle_without_leaks(state)
