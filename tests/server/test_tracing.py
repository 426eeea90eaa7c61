"""OpenTelemetry traces (`--otlp-traces-endpoint`) into a real OTLP/HTTP receiver in the test
process: one trace per request under the client's traceparent, vLLM's `gen_ai.*` attributes,
children whose durations add up to the request's, close to what the client measured, no
prompt text, and a malformed traceparent refused with 400."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from helpers.otlp import OtlpReceiver  # noqa: E402

pytestmark = pytest.mark.integration

PROMPT = "a very particular prompt text"


@contextlib.contextmanager
def traced_server(model: str, live_server, endpoint: str, **config):
    from kubeinfer.server.api.app import build_app
    from kubeinfer.server.api.state import ServerState
    from kubeinfer.server.api.tracing import Tracing
    from kubeinfer.server.engine.async_engine import AsyncEngine
    from kubeinfer.server.engine.config import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=model, dtype="float32", device="cpu", **config))
    tracing = Tracing(endpoint, 1.0)
    try:
        state = ServerState.create(engine, model, 1024)
        state.tracing = tracing
        with live_server(build_app(state, [])) as url:
            yield url, tracing
    finally:
        asyncio.run(engine.shutdown())
        tracing.shutdown()


def test_one_trace_per_request_under_the_clients_traceparent(tiny_model_path, live_server) -> None:
    receiver = OtlpReceiver()
    with traced_server(tiny_model_path, live_server, receiver.url) as (url, tracing):
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                         headers={"traceparent": "00-not-a-trace-01"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "traceparent"
        # a fresh engine's first decode steps record its graphs: not what this test times
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "warm", "max_tokens": 48, "ignore_eos": True},
                          timeout=120).status_code == 200
        clients = {}
        for i in range(3):
            trace_id, parent_id = f"{i + 1:032x}", f"{i + 0xabc:016x}"
            start = time.monotonic()
            reply = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": i == 2},
                               headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
            assert reply.status_code == 200
            clients[trace_id] = (parent_id, time.monotonic() - start)
        assert tracing.provider.force_flush(30_000)
    by_trace: dict[str, list] = {}
    for span in receiver.spans:
        by_trace.setdefault(span.trace_id.hex(), []).append(span)
    # one trace per request (the warm-up's is a root of its own), the refused one made none
    assert set(clients) < set(by_trace) and len(by_trace) == len(clients) + 1
    for trace_id, (parent_id, client_seconds) in clients.items():
        spans = {span.name: span for span in by_trace[trace_id]}
        assert sorted(spans) == ["admission", "decode", "llm_request", "prefill", "queue"]
        root = spans["llm_request"]
        assert root.parent_span_id.hex() == parent_id   # under the client's span
        attributes = {a.key: a.value for a in root.attributes}
        assert attributes["gen_ai.usage.completion_tokens"].int_value == 64
        assert attributes["gen_ai.usage.prompt_tokens"].int_value > 0
        assert attributes["gen_ai.request.max_tokens"].int_value == 64
        assert attributes["gen_ai.latency.time_to_first_token"].double_value > 0
        assert PROMPT not in str(receiver.spans)
        children = [spans[name] for name in ("admission", "queue", "prefill", "decode")]
        assert all(child.parent_span_id == root.span_id for child in children)
        total = root.end_time_unix_nano - root.start_time_unix_nano
        assert abs(sum(c.end_time_unix_nano - c.start_time_unix_nano for c in children) - total) <= 1000
        # the request's spans against the client's own clock: they start as the request reaches
        # the app (middleware.RequestClock) and end when it finishes, so they lie inside it.
        # How close they come (#42: within 5%) depends on the machine's load and, for this tiny
        # model's short requests, on the client's own overhead: benchmarks/tracing_cost.py measures
        # it (BENCHMARKS.md), this test does not assert it.
        assert 0 < total / 1e9 <= client_seconds, (total / 1e9, client_seconds)


def test_prefill_chunks_grammar_and_speculative_work_have_their_spans(tiny_model_path, live_server) -> None:
    """A prompt split into prefill chunks gets a `prefill_chunk` per chunk, tiling `prefill`;
    a structured output's grammar compile is a `grammar_compile` inside `admission`; the
    speculative tokens verified and accepted are counted on `decode`."""
    receiver = OtlpReceiver()
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    with traced_server(tiny_model_path, live_server, receiver.url, block_size=4, max_num_batched_tokens=8,
                       speculative_config=spec) as (url, tracing):
        for trace, body in ((1, {"prompt": prompt, "max_tokens": 16, "ignore_eos": True}),
                            (2, {"prompt": "Pick one", "max_tokens": 4,
                                 "structured_outputs": {"choice": ["yes", "no"]}})):
            reply = httpx.post(f"{url}/v1/completions", timeout=120, json=body,
                               headers={"traceparent": f"00-{trace:032x}-{trace:016x}-01"})
            assert reply.status_code == 200, reply.text
        assert tracing.provider.force_flush(30_000)
    by_trace: dict[int, list] = {}
    for span in receiver.spans:
        by_trace.setdefault(int(span.trace_id.hex(), 16), []).append(span)
    chunked = {span.name: span for span in by_trace[1] if span.name != "prefill_chunk"}
    chunks = sorted((span for span in by_trace[1] if span.name == "prefill_chunk"),
                    key=lambda span: span.start_time_unix_nano)
    prefill = chunked["prefill"]
    root_attributes = {a.key: a.value for a in chunked["llm_request"].attributes}
    computed = root_attributes["gen_ai.usage.prompt_tokens"].int_value - root_attributes["gen_ai.usage.cached_tokens"].int_value
    assert len(chunks) >= 5 and all(chunk.parent_span_id == prefill.span_id for chunk in chunks)
    assert sum({a.key: a.value for a in chunk.attributes}["kubeinfer.prefill.tokens"].int_value
               for chunk in chunks) == computed
    assert chunks[0].start_time_unix_nano == prefill.start_time_unix_nano
    assert chunks[-1].end_time_unix_nano == prefill.end_time_unix_nano
    assert all(a.end_time_unix_nano == b.start_time_unix_nano for a, b in zip(chunks, chunks[1:]))
    decode = {a.key: a.value for a in chunked["decode"].attributes}
    drafted = decode["kubeinfer.speculative.draft_tokens"].int_value
    assert drafted > 0 and 0 <= decode["kubeinfer.speculative.accepted_tokens"].int_value <= drafted
    structured = {span.name: span for span in by_trace[2]}
    assert structured["grammar_compile"].parent_span_id == structured["admission"].span_id
    assert structured["admission"].start_time_unix_nano <= structured["grammar_compile"].start_time_unix_nano
    assert structured["grammar_compile"].end_time_unix_nano <= structured["admission"].end_time_unix_nano
    root = {a.key: a.value for a in structured["llm_request"].attributes}
    assert root["kubeinfer.structured_output"].string_value == "choice"


def test_router_and_engine_spans_share_the_clients_trace(tiny_model_path, live_server) -> None:
    """Client -> `kubeinfer route` -> engine: the router's `route` span is a child of the
    client's span, its `pick` a child of it, and the engine's `llm_request` a child of `route`."""
    from kubeinfer.server.router.activator import Activator, ActivatorConfig, GatewayMetrics
    from kubeinfer.server.router.backends import StaticBackends
    from kubeinfer.server.router.proxy import build_app as build_router
    from kubeinfer.server.router.tracing import RouterTracing

    receiver = OtlpReceiver()
    with traced_server(tiny_model_path, live_server, receiver.url) as (engine_url, tracing):
        client = httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        activator = Activator(StaticBackends([engine_url], client), ActivatorConfig(activation_timeout=10),
                              GatewayMetrics())
        router_tracing = RouterTracing(receiver.url)
        with live_server(build_router(activator, "llm", http=client, tracing=router_tracing)) as router_url:
            bad = httpx.post(f"{router_url}/v1/completions", json={"prompt": "x"}, headers={"traceparent": "00-zz"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "traceparent"
            reply = httpx.post(f"{router_url}/v1/completions", timeout=60,
                               json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True},
                               headers={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})
            assert reply.status_code == 200 and "[DONE]" in reply.text
        router_tracing.shutdown()
        assert tracing.provider.force_flush(30_000)
    spans = {span.name: span for span in receiver.spans if span.trace_id.hex() == "ab" * 16}
    assert {"route", "pick", "llm_request"} <= set(spans)
    assert spans["route"].parent_span_id.hex() == "cd" * 8
    assert spans["pick"].parent_span_id == spans["route"].span_id
    assert spans["llm_request"].parent_span_id == spans["route"].span_id
    assert spans["route"].end_time_unix_nano >= spans["llm_request"].end_time_unix_nano
