"""The official openai client against `kubeinfer serve` on a tiny random model."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.unit

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_path):
    with start_server(tiny_model_path, served_model_name=MODEL, max_num_seqs=8,
                      kv_cache_memory=8 * 2**20, max_model_len=512) as (url, state):
        yield url, state


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


FIXED = {"ignore_eos": True}  # tiny random models may hit EOS at any point


def test_completion_usage_and_length(client: openai.OpenAI, server) -> None:
    prompt = "The quick brown fox"
    count = httpx.post(server[0] + "/tokenize", json={"prompt": prompt}).json()["count"]
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body=FIXED)
    assert result.object == "text_completion" and result.model == MODEL
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == count and result.usage.completion_tokens == 6
    assert result.usage.total_tokens == count + 6
    assert result.usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_matches_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello, world!", max_tokens=12, temperature=0, extra_body=FIXED)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_sse_frames_end_with_done(server) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 3, "stream": True, **FIXED}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_chat_stream_and_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "How are you today?"}]
    kwargs = dict(model=MODEL, messages=messages, temperature=0, max_completion_tokens=8, extra_body=FIXED)
    whole = client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_prompt_is_the_models_template(client: openai.OpenAI, server) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    rendered = httpx.post(server[0] + "/tokenize", json={"messages": messages}).json()
    text = httpx.post(server[0] + "/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert result.usage.prompt_tokens == rendered["count"]


def test_n_choices_and_seed_reproducibility(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Kubernetes schedules", max_tokens=8, n=3, temperature=1.0,
                  seed=1234, extra_body=FIXED)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 24
    other = client.completions.create(**{**kwargs, "seed": 99, "n": 1})
    assert len(other.choices) == 1


def test_stop_string_ends_generation(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="def main():", max_tokens=24, temperature=0, extra_body=FIXED)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index(stop)]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=3,
                                       temperature=0, extra_body=FIXED)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        # up to k + the sampled token; byte-level pieces may share one string key
        assert lp <= 0 and 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(lp)  # greedy = best


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
        top_logprobs=2, temperature=0, extra_body=FIXED)
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob == pytest.approx(token.logprob)


def test_prefix_cache_hits_show_as_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "Kubernetes schedules pods; the engine batches tokens; the cache shares prefixes. " * 3
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached < again.usage.prompt_tokens


def test_extra_params_and_user_are_accepted(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, user="alice", temperature=0.8,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5,
                    "priority": 1, "cache_salt": "tenant-a"})
    assert result.usage.completion_tokens == 5


def test_token_id_prompts_and_prompt_lists(client: openai.OpenAI, server) -> None:
    ids = httpx.post(server[0] + "/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0,
                                       extra_body=FIXED)
    by_text = client.completions.create(model=MODEL, prompt=["Hello", "Hello"], max_tokens=3, n=2,
                                        temperature=0, extra_body=FIXED)
    assert [c.index for c in by_ids.choices] == [0, 1] and [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert {c.text for c in by_ids.choices} == {c.text for c in by_text.choices} and len(by_ids.choices[0].text)
    assert by_ids.usage.prompt_tokens == 2 * len(ids) and by_text.usage.completion_tokens == 12


def test_models_version_and_probes(client: openai.OpenAI, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert httpx.get(server[0] + "/version").json()["version"]
    assert httpx.get(server[0] + "/health").status_code == 200
    assert httpx.get(server[0] + "/ready").status_code == 200
    roundtrip = httpx.post(server[0] + "/detokenize", json={"tokens": httpx.post(
        server[0] + "/tokenize", json={"prompt": "fox"}).json()["tokens"]}).json()
    assert roundtrip["prompt"] == "fox"


def test_chat_n_choices_stream_per_index(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], n=2, max_tokens=5,
                  temperature=1.0, seed=7, extra_body=FIXED)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
