"""A fault while handling one request fails that request alone (issue 28): with an exception
forced into one request's sampling, the others get exactly the tokens they get without it,
the failed one a clear error, and no KV block leaks."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kubeinfer.server.engine.sampler import Sampler

pytestmark = pytest.mark.unit

MARKER = 383  # first prompt token of the request whose sampling fails


@pytest.fixture(scope="module")
def server(start_server, tiny_model_path):
    with start_server(tiny_model_path, max_num_seqs=8, kv_cache_memory=8 * 2**20, max_model_len=256) as served:
        yield served


@pytest.fixture
def faulty_sampling(monkeypatch):
    """Sampling raises for any batch holding the marked request, as a bug in a logits
    processor, a penalty or a grammar matcher would."""
    original = Sampler._apply_penalties

    def apply_penalties(self, logits, seqs):
        if any(seq.token_ids[0] == MARKER for seq in seqs):
            raise RuntimeError("injected sampling fault")
        return original(self, logits, seqs)

    monkeypatch.setattr(Sampler, "_apply_penalties", apply_penalties)


def _bodies() -> list[dict]:
    """Eight requests: greedy and seeded sampling, with and without penalties; #3 is marked."""
    bodies = []
    for i in range(8):
        body = {"prompt": [MARKER if i == 3 else 10 + i] + [20 + 7 * i + k for k in range(3 + i)],
                "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
        body |= {"temperature": 0.8, "seed": 100 + i, "top_p": 0.9} if i % 2 else {"temperature": 0}
        if i % 3 == 0:
            body |= {"repetition_penalty": 1.3, "frequency_penalty": 0.5}
        bodies.append(body)
    bodies[3] |= {"stream": True}
    return bodies


def _run_together(url: str, bodies: list[dict]) -> list[object]:
    results: list[object] = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def run(i: int) -> None:
        start.wait()
        if bodies[i].get("stream"):
            with httpx.stream("POST", url + "/v1/completions", json=bodies[i], timeout=120) as response:
                results[i] = (response.status_code, [line for line in response.iter_lines() if line])
        else:
            response = httpx.post(url + "/v1/completions", json=bodies[i], timeout=120)
            results[i] = (response.status_code, response.json())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return results


def _tokens(result) -> tuple[str, list[str]]:
    status, body = result
    assert status == 200, body
    choice = body["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def _wait_idle_without_leaks(state) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = state.engine.stats()
        idle = stats.num_running == stats.num_waiting == 0
        if idle and stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_a_sampling_fault_fails_one_of_eight_requests_and_no_other(server, monkeypatch) -> None:
    url, state = server
    bodies = _bodies()
    clean = _run_together(url, bodies)
    expected = {i: _tokens(r) for i, r in enumerate(clean) if i != 3}
    _wait_idle_without_leaks(state)

    original = Sampler._apply_penalties
    calls = {"faulted": 0}

    def apply_penalties(self, logits, seqs):  # the marked request fails mid-stream, at its 4th token
        if any(seq.token_ids[0] == MARKER and seq.num_output_tokens == 3 for seq in seqs):
            calls["faulted"] += 1
            raise RuntimeError("injected sampling fault")
        return original(self, logits, seqs)

    monkeypatch.setattr(Sampler, "_apply_penalties", apply_penalties)
    faulty = _run_together(url, bodies)
    assert calls["faulted"] >= 1
    assert {i: _tokens(r) for i, r in enumerate(faulty) if i != 3} == expected
    status, lines = faulty[3]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert sum(len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]) for line in lines[:-2]) == 3
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "request_failed" and "failed while generating" in error["message"]
    _wait_idle_without_leaks(state)
    assert state.engine.is_alive() and httpx.get(url + "/ready").status_code == 200


def test_a_failed_non_streaming_request_is_a_500_and_the_next_one_is_served(server, faulty_sampling) -> None:
    url, state = server
    response = httpx.post(url + "/v1/completions", json={"prompt": [MARKER, 5, 6], "max_tokens": 4}, timeout=60)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "request_failed"
    assert "RuntimeError" in error["message"] and "injected" not in error["message"]
    assert httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}).status_code == 200
    _wait_idle_without_leaks(state)
