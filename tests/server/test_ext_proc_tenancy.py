"""`kubeinfer route --ext-proc-port` with tenants: the endpoint picker behind Envoy applies the
HTTP router's tenancy (server/router/tenancy.py) to what Envoy forwards, driven by a real gRPC
client speaking Envoy's ext_proc (GIE's FULL_DUPLEX_STREAMED bodies) in front of a real engine.

- the key and the trusted tenant header: 401 and 400 as immediate responses in OpenAI's error
  JSON, naming the header or the `priority` param; probes' paths stay open;
- quotas: 429 with Retry-After and the limit's headers, counted per tenant in
  `kubeinfer:tenant_requests_total`;
- tokens: the estimate is reserved when the request is routed, replaced by the `usage` of the
  engine's streamed answer, and given back when the stream is cut;
- hostile headers, bodies and streams cut anywhere (hypothesis, against the servicer in this
  process so its buckets can be read): never a 5xx, no reservation leaked, nothing left in
  flight, memory bounded however long the answer.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import tracemalloc
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from helpers.serve_process import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ext_proc import DESTINATION, _engine, _exchange, _router

from e2e.helpers import wait_for
from kubeinfer.server.router.activator import Activator, ActivatorConfig, GatewayMetrics
from kubeinfer.server.router.backends import StaticBackends
from kubeinfer.server.router.ext_proc import EndpointPicker, PickerSettings, start_server
from kubeinfer.server.router.tenancy import RouterTenancy
from kubeinfer.server.tenancy import TenantTable

pytestmark = pytest.mark.integration
TENANTS = {
    "priority_range": [0, 10],
    "objectives": {"interactive": 0, "batch": 8},
    "tenants": [
        {"name": "team-a", "keys": ["sk-a"], "priority": 2},
        {"name": "team-r", "keys": ["sk-r"], "quotas": {"requests_per_minute": 1}},
        {"name": "team-t", "keys": ["sk-t"], "quotas": {"tokens_per_minute": 60}},
        {"name": "team-u", "keys": ["sk-u"], "quotas": {"tokens_per_minute": 60}},
    ]}
# JSON whitespace the engine skips: the router's estimate (body bytes / 4) is ~10,000 tokens above the usage
PADDING = " " * 40_000
FUZZ_QUOTA = 60_000_000_000   # tokens per minute: a bucket of 10^9, never empty in the fuzz


@pytest.fixture(scope="module")
def engine(tiny_model_path: str) -> Iterator[str]:
    with ExitStack() as stack:
        yield _engine(tiny_model_path, stack)


@pytest.fixture(scope="module")
def picker(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(ext_proc address, its metrics URL) of a router with tenants."""
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.json"
    tenants.write_text(json.dumps(TENANTS))
    port = free_port()
    with ExitStack() as stack:
        address = _router([engine], stack, "--tenants-file", str(tenants), "--trust-tenant-header",
                          "--metrics-port", str(port))   # ext_proc only (--no-http), as the operator runs it
        yield address, f"http://127.0.0.1:{port}"


def _messages(headers: dict[str, str], body: bytes | None) -> list[pb.ProcessingRequest]:
    pairs = {":method": "POST" if body is not None else "GET", "content-type": "application/json", **headers}
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in pairs.items()]), end_of_stream=body is None))
    if body is None:
        return [first]
    return [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


def _completion(key: str | None, body: dict | bytes, **headers: str) -> list[pb.ProcessingRequest]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = {"authorization": f"Bearer {key}"} if key is not None else {}
    return _messages({":path": "/v1/completions", **auth, **headers}, data)


def _refusal(responses: list[pb.ProcessingResponse]) -> tuple[int, dict, dict[str, str]]:
    """(status, error object, headers) of an immediate response."""
    answer = responses[0].immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    return answer.status.code, json.loads(answer.body)["error"], headers


def _routed(responses: list[pb.ProcessingResponse]) -> str | None:
    if not responses or responses[0].WhichOneof("response") != "request_headers":
        return None
    mutation = responses[0].request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}.get(DESTINATION)


def _refused_count(metrics_url: str, tenant: str, outcome: str) -> float:
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    found = re.search(rf'^kubeinfer:tenant_requests_total\{{(?=[^}}]*outcome="{outcome}")(?=[^}}]*tenant="{tenant}")'
                      rf'[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


class _Stream:
    """One ext_proc stream held open: messages sent one at a time, each answer read as it comes."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outbox: queue.Queue = queue.Queue()
        self.answers = pb_grpc.ExternalProcessorStub(self.channel).Process(iter(self.outbox.get, None), timeout=60)

    def send(self, *messages: pb.ProcessingRequest, answers: int = 1) -> list[pb.ProcessingResponse]:
        for message in messages:
            self.outbox.put(message)
        return [next(self.answers) for _ in range(answers)]

    def cut(self) -> None:
        """The gateway resets the stream (the client went away mid-answer)."""
        self.answers.cancel()
        self.channel.close()


def test_keys_and_tenant_headers_get_the_http_routers_401_and_400(picker, engine: str) -> None:
    address, metrics = picker
    status, error, headers = _refusal(_exchange(address, _completion(None, {"prompt": "x"})))
    assert (status, error["code"], headers["www-authenticate"]) == (401, "invalid_api_key", "Bearer")
    assert error["type"] == "authentication_error" and "missing API key" in error["message"]
    status, error, _ = _refusal(_exchange(address, _completion("sk-wrong", {"prompt": "x"})))
    assert status == 401 and error["message"] == "incorrect API key provided"
    status, error, _ = _refusal(_exchange(address, _completion(
        "sk-a", {"prompt": "x"}, **{"x-gateway-inference-fairness-id": "two words"})))
    assert (status, error["param"], error["code"]) == (400, "x-gateway-inference-fairness-id", "invalid_tenant")
    status, error, _ = _refusal(_exchange(address, _completion(
        "sk-a", {"prompt": "x"}, **{"x-llm-d-inference-objective": "urgent"})))
    assert (status, error["param"]) == (400, "x-gateway-inference-objective")
    before = _refused_count(metrics, "team-a", "invalid_priority")
    status, error, _ = _refusal(_exchange(address, _completion("sk-a", {"prompt": "x", "priority": 1})))
    assert (status, error["param"], error["code"]) == (400, "priority", "invalid_priority")
    assert "allowed 2 to 10" in error["message"]
    assert _refused_count(metrics, "team-a", "invalid_priority") == before + 1
    assert _routed(_exchange(address, _completion("sk-a", {"prompt": "x", "priority": 3}))) == engine
    assert _routed(_exchange(address, _completion(   # the trusted gateway's objective may use the whole range
        "sk-a", {"prompt": "x"}, **{"x-gateway-inference-objective": "interactive"}))) == engine
    assert _routed(_exchange(address, _messages({":path": "/health"}, None))) == engine   # probes stay open


def test_a_tenant_over_its_request_quota_gets_429_with_retry_after_and_the_limit(picker, engine: str) -> None:
    address, metrics = picker
    before = _refused_count(metrics, "team-r", "rate_limited")
    assert _routed(_exchange(address, _completion("sk-r", {"prompt": "x", "max_tokens": 1}))) == engine
    status, error, headers = _refusal(_exchange(address, _completion("sk-r", {"prompt": "x", "max_tokens": 1})))
    assert (status, error["code"], error["type"]) == (429, "rate_limit_exceeded", "requests")
    assert "team-r" in error["message"] and "limit 1" in error["message"]
    assert 50 <= int(headers["retry-after"]) <= 60   # one request a minute
    assert headers["x-kubeinfer-rate-limit"] == "requests_per_minute"
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert headers["content-type"] == "application/json"
    assert _refused_count(metrics, "team-r", "rate_limited") == before + 1
    assert _routed(_exchange(address, _completion("sk-a", {"prompt": "x"}))) == engine   # others pass


def test_the_answers_usage_settles_the_reserved_estimate(picker, engine: str) -> None:
    address, _ = picker
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}) + PADDING
    stream = _Stream(address)
    try:
        first = stream.send(*_completion("sk-t", body.encode()), answers=2)   # headers, then the body back
        assert _routed(first) == engine
        # in flight, its ~10,000 estimated tokens hold the tenant's 60 a minute: refused for hours
        status, error, headers = _refusal(_exchange(address, _completion("sk-t", {"prompt": "x"})))
        assert (status, error["type"], headers["x-kubeinfer-rate-limit"]) == (429, "tokens", "tokens_per_minute")
        assert int(headers["retry-after"]) > 9000
        with httpx.stream("POST", f"http://{engine}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60) as answer:
            stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")]))))
            raw = b""
            for chunk in answer.iter_raw():
                raw += chunk
                stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
        stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    finally:
        stream.cut()
    usage = [json.loads(line[6:])["usage"] for line in raw.decode().splitlines()
             if line.startswith("data: {") and json.loads(line[6:]).get("usage")][-1]
    used = usage["prompt_tokens"] + usage["completion_tokens"]
    # charged its usage (over 8 tokens against one a second), not the estimate, nor nothing: seconds to wait
    status, _, headers = _refusal(_exchange(address, _completion("sk-t", {"prompt": "x", "max_tokens": 1})))
    assert status == 429 and 1 <= int(headers["retry-after"]) <= used

    cut = _Stream(address)   # team-u: the gateway resets the stream mid-answer: the estimate comes back
    assert _routed(cut.send(*_completion("sk-u", body.encode()), answers=2)) == engine
    cut.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
    cut.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b'data: {"choices": []}\n\n')))
    cut.cut()
    wait_for(lambda: _routed(_exchange(address, _completion("sk-u", {"prompt": "x"}))),
             "team-u admitted again once its cut stream gave its estimate back", timeout=10, interval=0.1)


# -- hostile input against the servicer in this process ------------------------------------------

@pytest.fixture(scope="module")
def local_picker(engine: str) -> Iterator[tuple[EndpointPicker, RouterTenancy, str]]:
    """The servicer on a loop of its own thread, its quotas on a stopped clock (no refill hides a leak)."""
    table = TenantTable.model_validate({"tenants": [
        {"name": "f", "keys": ["sk-f"], "quotas": {"tokens_per_minute": FUZZ_QUOTA}}]})
    tenancy = RouterTenancy(table, True, 1, [], clock=lambda: 0.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[EndpointPicker, grpc.aio.Server, int, httpx.AsyncClient]:
        client = httpx.AsyncClient()
        activator = Activator(StaticBackends([f"http://{engine}"], client), ActivatorConfig(), GatewayMetrics())
        endpoint_picker = EndpointPicker(activator, None, PickerSettings(max_body_bytes=8192), tenancy)
        server, port = await start_server(endpoint_picker, "127.0.0.1", 0)
        return endpoint_picker, server, port, client

    endpoint_picker, server, port, client = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield endpoint_picker, tenancy, f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _level(tenancy: RouterTenancy) -> float:
    return tenancy.limiter.tokens["f"].level


HOSTILE_TEXT = st.text(st.characters(min_codepoint=1, max_codepoint=0x2FFF), max_size=200)
BODIES = st.one_of(
    st.binary(max_size=400),
    st.fixed_dictionaries({"prompt": st.text(max_size=50)}, optional={
        "priority": st.one_of(st.integers(-10**30, 10**30), st.text(max_size=5), st.none()),
        "max_tokens": st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=True)),
        "n": st.integers(-5, 10**9), "model": st.text(max_size=20)}).map(lambda d: json.dumps(d).encode()),
    st.just(b"x" * 9000))   # past the body limit: 413


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(auth=st.one_of(st.none(), st.just("Bearer sk-f"), HOSTILE_TEXT),
       fairness=st.one_of(st.none(), st.sampled_from(["f", "fuzz-team", "x" * 129]), HOSTILE_TEXT),
       objective=st.one_of(st.none(), st.sampled_from(["3", "-1000", "9" * 5000]), HOSTILE_TEXT),
       body=BODIES, chunk=st.integers(1, 500), request_cut=st.booleans(),
       status=st.sampled_from(["200", "500", "429", ""]), encoded=st.booleans(),
       answer=st.binary(max_size=3000).filter(lambda b: b"_tokens" not in b),
       ending=st.sampled_from(["usage", "no-usage", "cut", "none"]),
       usage=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)))
def test_hostile_headers_bodies_and_cut_streams_get_no_5xx_and_leak_no_reservation(
        local_picker, auth, fairness, objective, body, chunk, request_cut, status, encoded, answer, ending,
        usage) -> None:
    endpoint_picker, tenancy, address = local_picker
    before = _level(tenancy)
    headers = {":path": "/v1/completions", **({"authorization": auth} if auth is not None else {}),
               **({"x-gateway-inference-fairness-id": fairness} if fairness is not None else {}),
               **({"x-gateway-inference-objective": objective} if objective is not None else {})}
    head, _ = _messages(headers, b"")
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    if request_cut:
        pieces = pieces[:max(1, len(pieces) // 2)]
    stream = _Stream(address)
    charged = 0
    try:
        replies = stream.send(head, answers=0)
        for index, piece in enumerate(pieces):
            stream.outbox.put(pb.ProcessingRequest(request_body=pb.HttpBody(
                body=piece, end_of_stream=not request_cut and index == len(pieces) - 1)))
        if not request_cut:
            replies = [next(stream.answers)]
            if replies[0].HasField("immediate_response"):
                assert 400 <= replies[0].immediate_response.status.code < 500, replies[0]
            else:
                assert _routed(replies)
                stream.send(answers=len(range(0, max(len(body), 1), 62_000)))   # the body given back
                if ending != "none":
                    response = [base_pb2.HeaderValue(key=":status", raw_value=status.encode())] if status else []
                    if encoded:
                        response.append(base_pb2.HeaderValue(key="content-encoding", raw_value=b"gzip"))
                    stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(
                        headers=base_pb2.HeaderMap(headers=response))))
                    tail = b'{"usage": {"prompt_tokens": %d, "completion_tokens": %d}}' % usage
                    stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer)))
                    if ending != "cut":
                        stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(
                            body=tail if ending == "usage" else b"", end_of_stream=True)))
                        if ending == "usage" and status == "200" and not encoded:
                            charged = sum(usage)
    finally:
        stream.cut()
    wait_for(lambda: _level(tenancy) == before - charged and not any(endpoint_picker.activator.in_flight.values()),
             f"the bucket back at {before - charged} (it is {_level(tenancy)}) and nothing in flight",
             timeout=10, interval=0.01)


def test_a_long_answer_keeps_the_pickers_memory_bounded(local_picker) -> None:
    """32 MiB of answer through one stream: the picker keeps only the tail it reads usage from."""
    endpoint_picker, tenancy, address = local_picker
    stream = _Stream(address)
    try:
        assert _routed(stream.send(*_completion("sk-f", {"prompt": "x"}), answers=2))
        stream.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
        tracemalloc.start()
        try:
            for _ in range(32):
                stream.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"d" * (1 << 20))))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 12 << 20, f"traced peak {peak} bytes for 32 MiB streamed"
    finally:
        stream.cut()
