"""Behaviour under load on the real engine held busy (max_num_seqs=1): exact queue gauges,
queue-full 503s that lose no admitted work, disconnects that free KV blocks, and
counters/histograms that add up."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.unit

MODEL = "tiny"
HOLD = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_path):
    with start_server(tiny_model_path, served_model_name=MODEL, max_num_seqs=1, max_queued_requests=3,
                      kv_cache_memory=8 * 2**20, max_model_len=2048) as (url, state):
        yield url, state


def scrape(url: str) -> dict[str, float]:
    """Samples by name; request_success is keyed `name{reason}`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            values[f"{sample.name}{{{reason}}}" if reason else sample.name] = sample.value
    return values


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


class HeldStream:
    """A long streaming request that occupies the engine until `release()` disconnects it."""

    def __init__(self, url: str) -> None:
        self.started, self.release_event = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the held stream produced no token"

    def _run(self, url: str) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=HOLD, timeout=120) as response:
            lines = response.iter_lines()  # kept referenced: closing it would disconnect
            for line in lines:
                if line.startswith("data: {"):
                    self.started.set()
                    break
            self.release_event.wait(120)
        # leaving the block closes the connection mid-stream: a client disconnect

    def release(self) -> None:
        self.release_event.set()
        self.thread.join(30)


def _post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(
        httpx.post(url + "/v1/completions", json=body, timeout=120)), daemon=True)
    thread.start()
    return thread


def test_waiting_gauge_is_exact_and_a_full_queue_answers_503_without_losing_work(server) -> None:
    url, _ = server
    held = HeldStream(url)
    wait_for(lambda: scrape(url)["vllm:num_requests_running"] == 1)
    results: list[httpx.Response] = []
    threads = []
    for queued in range(1, 4):
        threads.append(_post_in_thread(url, {"prompt": f"question {queued}", "max_tokens": 4,
                                             "ignore_eos": True}, results))
        wait_for(lambda: scrape(url)["vllm:num_requests_waiting"] == queued)
        metrics = scrape(url)
        assert metrics["vllm:num_requests_waiting"] == queued and metrics["vllm:num_requests_running"] == 1
    refused = httpx.post(url + "/v1/completions", json={"prompt": "one too many", "max_tokens": 4})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    assert scrape(url)["kubeinfer:requests_rejected_total"] >= 1
    held.release()
    for thread in threads:
        thread.join(120)
    assert [r.status_code for r in results] == [200, 200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)
    wait_for(lambda: scrape(url)["vllm:num_requests_waiting"] == 0)


def test_disconnect_mid_stream_frees_blocks_at_once(server) -> None:
    url, _ = server
    wait_for(lambda: scrape(url)["vllm:num_requests_running"] == 0)
    before = scrape(url)
    idle_usage = before["vllm:kv_cache_usage_perc"]
    held = HeldStream(url)
    busy = scrape(url)
    assert busy["vllm:kv_cache_usage_perc"] > idle_usage and busy["vllm:num_requests_running"] == 1
    held.release()
    wait_for(lambda: scrape(url)["vllm:kv_cache_usage_perc"] == idle_usage, timeout=10)
    after = scrape(url)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:request_success_total{abort}"] == before.get("vllm:request_success_total{abort}", 0) + 1
    # far fewer than the 2000 tokens asked for were generated: the abort was immediate
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 1000


def test_metrics_count_every_finished_request(server) -> None:
    url, _ = server
    wait_for(lambda: scrape(url)["vllm:num_requests_running"] == 0)
    before = scrape(url)
    n, tokens = 5, 3
    prompt_tokens = 0
    for i in range(n):
        body = {"prompt": f"request number {i}", "max_tokens": tokens, "ignore_eos": True, "stream": i % 2 == 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            response.read()
        prompt_tokens += httpx.post(url + "/tokenize", json={"prompt": body["prompt"]}).json()["count"]
    after = scrape(url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:request_success_total{length}") == n
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds", "vllm:request_time_per_output_token_seconds"):
        assert delta(histogram + "_count") == n, histogram
    assert delta("vllm:inter_token_latency_seconds_count") == n * (tokens - 1)
    assert delta("vllm:generation_tokens_total") == n * tokens
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:prefix_cache_queries_total") >= 0 and after["kubeinfer:engine_steps_total"] > 0
