"""`kubeinfer serve --speculative-config` through the HTTP API on the tiny Llama: streamed and
whole answers equal the non-speculative server's, vLLM's spec-decode counters show on /metrics,
and clients that disconnect mid-stream leave no KV block behind."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.unit

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def main():\n    return [x * 2 for x in range(10)]\ndef main():",
           "Hello, world! How are you today? Hello, world! How"]


@pytest.fixture(scope="module")
def servers(start_server, tiny_model_path):
    kwargs = dict(served_model_name="tiny", max_num_seqs=8, kv_cache_memory=8 * 2**20, block_size=4)
    with start_server(tiny_model_path, **kwargs) as (plain_url, _), \
            start_server(tiny_model_path, speculative_config=SPEC, **kwargs) as (url, state):
        yield plain_url, url, state


def _complete(url: str, prompt: str, stream: bool) -> tuple[str, list[str], str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "stream": stream}
    if not stream:
        choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]
    text, tokens, reason = "", [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                tokens += (choice.get("logprobs") or {}).get("tokens") or []
                reason = choice["finish_reason"] or reason
    return text, tokens, reason


def _spec_counters(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode"):
                position = sample.labels.get("position")
                values[sample.name + (f"[{position}]" if position else "")] = sample.value
    return values


def test_streamed_and_whole_answers_equal_the_plain_servers(servers) -> None:
    plain_url, url, _ = servers
    for prompt in PROMPTS:
        want = _complete(plain_url, prompt, stream=False)
        assert len(want[1]) == 40 and want[2] == "length"
        assert _complete(url, prompt, stream=False) == want
        assert _complete(url, prompt, stream=True) == want
    counters = _spec_counters(url)
    assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens_total"] >= counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert counters["vllm:spec_decode_num_drafts_total"] > 0
    per_pos = [counters[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(4)]
    assert sum(per_pos) == counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert not _spec_counters(plain_url)


def test_disconnected_speculative_streams_free_their_blocks(servers) -> None:
    _, url, state = servers

    def read_a_few_then_hang_up(prompt: str) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for count, line in enumerate(response.iter_lines()):
                if count >= 6:
                    return   # leaving the block disconnects mid-stream

    accepted = _spec_counters(url)["vllm:spec_decode_num_accepted_tokens_total"]
    threads = [threading.Thread(target=read_a_few_then_hang_up, args=(PROMPTS[i % 3] + " " * i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    deadline = time.monotonic() + 60
    while True:
        stats = state.engine.stats()
        if stats.num_running == stats.num_waiting == 0 and (
                stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats.kv_cache_usage == 0.0
    assert _spec_counters(url)["vllm:spec_decode_num_accepted_tokens_total"] > accepted
