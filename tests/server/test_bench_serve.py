"""`kubeinfer bench serve` against a scripted OpenAI endpoint on 127.0.0.1 (a test double
for the load generator only: the real server is tested against the real engine)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
import pytest

from kubeinfer.server.bench import serve as bench_serve
from kubeinfer.server.bench.serve_datasets import DatasetConfig, build_dataset

pytestmark = pytest.mark.unit


class ScriptedEndpoint:
    """Streams `max_tokens` one-word chunks; every `fail_every`-th request gets a 503."""

    def __init__(self, fail_every: int = 0) -> None:
        self.in_flight = self.max_in_flight = self.requests = 0
        self.fail_every = fail_every
        self.bodies: list[dict] = []
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.completions)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    async def completions(self, request: Request):
        body = await request.json()
        self.requests += 1
        self.bodies.append(body)
        if self.fail_every and self.requests % self.fail_every == 0:
            return JSONResponse({"error": {"message": "queue full"}}, status_code=503)
        return StreamingResponse(self._stream(body), media_type="text/event-stream")

    async def _stream(self, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            chat = "messages" in body
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                choice = {"index": 0, "delta": {"content": " w"}} if chat else {"index": 0, "text": " w"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"], "total_tokens": 0}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _bench(url: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    code = bench_serve.run(parser.parse_args(["--base-url", url, "--num-prompts", "12", "--output-len", "5",
                 "--input-len", "8", "--warmup", "1", "--no-progress", "--json", str(out), *extra]))
    result = json.loads(out.read_text())
    result["exit_code"] = code
    return result


def test_sweep_reports_every_level_and_respects_concurrency(live_server, tmp_path: Path) -> None:
    endpoint = ScriptedEndpoint()
    with live_server(endpoint.app) as url:
        result = _bench(url, tmp_path, "--concurrency", "1,3")
    assert result["exit_code"] == 0
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]
    for level in result["levels"]:
        assert level["completed"] == 12 and level["errors"] == 0
        assert level["output_tokens"] == 12 * 5 and level["prompt_tokens"] == 12 * 7
        assert level["output_throughput"] > 0 and level["ttft_ms"]["p50"] <= level["e2e_ms"]["p99"]
        assert level["itl_ms"]["p50"] > 0 and level["tpot_ms"]["p99"] > 0
    assert endpoint.max_in_flight == 3
    # Each level sends its own prompts (else the second would hit the server's prefix cache),
    # the seeded ones every engine gets at that level.
    level_prompts = [[tuple(b["prompt"]) for b in endpoint.bodies[1 + 12 * i:13 + 12 * i]] for i in range(2)]
    assert not set(level_prompts[0]) & set(level_prompts[1])
    assert sorted(level_prompts[1]) == sorted(tuple(r.prompt) for r in build_dataset(DatasetConfig(
        name="random", num_prompts=12, input_len=8, output_len=5, seed=bench_serve.level_seed(0, "random", 3))))
    body = endpoint.bodies[-1]
    assert body["model"] == "scripted" and body["ignore_eos"] is True and body["stream"] is True
    assert len(body["prompt"]) == 8 and all(isinstance(t, int) for t in body["prompt"])


def test_extra_body_reaches_every_measured_request(live_server, tmp_path: Path) -> None:
    endpoint = ScriptedEndpoint()
    with live_server(endpoint.app) as url:
        _bench(url, tmp_path, "--concurrency", "2", "--no-ignore-eos",
               "--extra-body", '{"guided_regex": "[a-z]+"}')
    assert "guided_regex" not in endpoint.bodies[0]  # the warmup is plain
    assert all(body["guided_regex"] == "[a-z]+" and "ignore_eos" not in body for body in endpoint.bodies[1:])


def test_errors_are_counted_not_fatal(live_server, tmp_path: Path) -> None:
    endpoint = ScriptedEndpoint(fail_every=4)
    with live_server(endpoint.app) as url:
        result = _bench(url, tmp_path, "--concurrency", "2", "--warmup", "0")
    level = result["levels"][0]
    assert level["completed"] == 9 and level["errors"] == 3
    assert any("HTTP 503" in sample for sample in level["error_samples"])


def test_poisson_rate_and_chat_dataset(live_server, tmp_path: Path) -> None:
    endpoint = ScriptedEndpoint()
    with live_server(endpoint.app) as url:
        result = _bench(url, tmp_path, "--dataset", "chat", "--concurrency", "4", "--request-rate", "200")
    assert result["levels"][0]["completed"] == 12
    assert "messages" in endpoint.bodies[-1]


def test_shared_prefix_groups_share_their_prefix() -> None:
    requests = build_dataset(DatasetConfig(name="shared-prefix", num_prompts=6, num_groups=2,
                                           prefix_len=16, input_len=4))
    prefixes = {tuple(r.prompt[:16]) for r in requests}
    assert len(requests) == 6 and len(prefixes) == 2
    assert all(len(r.prompt) == 20 for r in requests)
    assert len({tuple(r.prompt) for r in requests}) == 6


def test_levels_of_other_runs_share_no_prompt_prefix() -> None:
    # seed + concurrency once gave --seed 116 at c=16 the prompts of --seed 100 at c=32: all cached.
    def starts(seed: int, dataset: str, concurrency: int) -> set[tuple[int, ...]]:
        return {tuple(r.prompt[:8]) for r in build_dataset(DatasetConfig(
            name=dataset, num_prompts=16, input_len=8, prefix_len=8,
            seed=bench_serve.level_seed(seed, dataset, concurrency)))}

    assert not starts(116, "random", 16) & starts(100, "random", 32)
    assert not starts(100, "random", 16) & starts(100, "shared-prefix", 16)
    assert starts(100, "random", 32) == starts(100, "random", 32)   # a rerun sends the same ones


def test_plot_writes_a_png_or_says_matplotlib_is_missing(tmp_path: Path) -> None:
    import importlib.util

    import pytest

    from kubeinfer.server.bench.serve_client import RequestResult
    from kubeinfer.server.bench.serve_report import plot, summarize

    result = RequestResult(True, prompt_tokens=5, output_tokens=3, ttft=0.1, e2e=0.3, itl=[0.1, 0.1])
    reports = [summarize([result], 1.0, level, float("inf")) for level in (1, 4)]
    target = tmp_path / "sweep.png"
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SystemExit, match="pip install matplotlib"):
            plot(reports, str(target), "run")
        return
    plot(reports, str(target), "run")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_duration_stops_starting_requests(live_server, tmp_path: Path) -> None:
    endpoint = ScriptedEndpoint()
    with live_server(endpoint.app) as url:
        result = _bench(url, tmp_path, "--concurrency", "1", "--warmup", "0", "--output-len", "40",
                        "--max-duration", "0.2")
    level = result["levels"][0]
    assert 1 <= level["completed"] < 12 and level["errors"] == 0
    assert endpoint.requests == level["completed"]


def test_grounded_dataset_asks_about_a_passage_of_the_shipped_corpus() -> None:
    corpus = Path(__file__).resolve().parents[2] / "benchmarks" / "corpus"
    passages = [path.read_text().strip() for path in sorted(corpus.glob("*.txt"))]
    requests = build_dataset(DatasetConfig(name="grounded", num_prompts=20, corpus=str(corpus), seed="s"))
    assert len(passages) >= 5 and len(requests) == 20
    for request in requests:
        [message] = request.messages
        passage, task = message["content"].rsplit("\n\n", 1)
        assert passage in passages and "the text above" in task
    assert requests == build_dataset(DatasetConfig(name="grounded", num_prompts=20, corpus=str(corpus), seed="s"))
    try:
        build_dataset(DatasetConfig(name="grounded", corpus=str(corpus / "missing")))
    except ValueError as error:
        assert "no .txt passages" in str(error)
    else:
        raise AssertionError("an empty corpus was accepted")
