"""`kubeinfer route --ext-proc-port`: the router as a Gateway API Inference Extension endpoint
picker, driven by a real gRPC client speaking Envoy's ext_proc as a gateway does (GIE's modes:
bodies FULL_DUPLEX_STREAMED), in front of two real engines on loopback.

Checked against GIE's endpoint-picker protocol: the destination as header and `envoy.lb` metadata
(the same `ip:port` list, picked endpoint first), the subset hint, 503 without a ready endpoint,
429 when shedding, gRPC health, the body given back whole after the pick and response chunks echoed
at once; bad input (not JSON, an unknown model, protocol violations) answered clearly while the
picker keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from typing import Iterator

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.serve_process import free_port, start_kubeinfer, stop_process

pytestmark = pytest.mark.integration
DESTINATION = "x-gateway-destination-endpoint"
Mode = processing_mode_pb2.ProcessingMode


def _engine(model: str, stack: ExitStack, *extra: str) -> str:
    port = free_port()
    start_kubeinfer(["serve", "--model", model, "--dtype", "float32", "--block-size", "4",
                     "--max-model-len", "4096", *extra], port, stack)
    return f"127.0.0.1:{port}"


def _router(backends: list[str], stack: ExitStack, *extra: str) -> str:
    """A router with ext_proc; returns the ext_proc address once gRPC health answers SERVING."""
    grpc_port = free_port()
    args = ["route", *(a for b in backends for a in ("--backend", f"http://{b}")), "--no-http",
            "--ext-proc-port", str(grpc_port), "--poll-interval", "0.2", *extra]
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    stack.callback(stop_process, process, 15)
    address = f"127.0.0.1:{grpc_port}"
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else "router exited"
            try:
                if health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status == 1:
                    return address
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "the ext_proc server never answered"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def pool(tiny_model_path: str) -> Iterator[tuple[list[str], str, str]]:
    """Two engines, a prefix-aware picker with one fallback, and the router's HTTP URL."""
    with ExitStack() as stack:
        engines = [_engine(tiny_model_path, stack, "--max-num-seqs", "1") for _ in range(2)]
        picker = _router(engines, stack, "--fallback-endpoints", "1")
        _wait_for_tokenizer(picker)
        yield engines, picker, tiny_model_path


def _wait_for_tokenizer(picker: str) -> None:
    """The router learns the tokenizer from the engines: until then requests carry no key."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        responses = _exchange(picker, _request("/v1/completions", {"prompt": "warm up " * 8, "max_tokens": 1}))
        if responses and responses[0].WhichOneof("response") == "request_headers":
            return
        time.sleep(0.2)


def _headers(pairs: dict[str, str], end_of_stream: bool = False,
             subset: list[str] | None = None, mode: int = Mode.FULL_DUPLEX_STREAMED) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
            end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def _request(path: str, body: dict | bytes, chunk: int = 0, subset: list[str] | None = None,
             mode: int = Mode.FULL_DUPLEX_STREAMED) -> list[pb.ProcessingRequest]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)] if chunk else [data]
    return [_headers({":method": "POST", ":path": path, "content-type": "application/json"}, subset=subset,
                     mode=mode)] + [pb.ProcessingRequest(request_body=pb.HttpBody(
                         body=piece, end_of_stream=index == len(pieces) - 1)) for index, piece in enumerate(pieces)]


def _exchange(address: str, messages: list[pb.ProcessingRequest], timeout: float = 10) -> list[pb.ProcessingResponse]:
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=timeout))


def _destination(response: pb.ProcessingResponse) -> tuple[str, str]:
    """(header value, envoy.lb metadata value) of a headers answer."""
    mutation = response.request_headers.response.header_mutation
    header = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}[DESTINATION]
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
    return header, metadata


def _chat(tenant: int) -> dict:
    system = f"Tenant {tenant} rules: " + " ".join(f"rule {i} of tenant {tenant}." for i in range(40))
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
            "max_tokens": 1}


def test_health_answers_serving_for_each_service(pool) -> None:
    _, picker, _ = pool
    with grpc.insecure_channel(picker) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_streamed_request_gets_its_destination_then_its_body_back(pool) -> None:
    engines, picker, _ = pool
    body = json.dumps(_chat(0)).encode()
    messages = _request("/v1/chat/completions", body, chunk=100)
    messages += [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b'data: {"a": 1}\n\n')),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))]
    responses = _exchange(picker, messages)
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "request_headers" and kinds[-3:] == ["response_headers", "response_body", "response_body"]
    header, metadata = _destination(responses[0])
    assert header == metadata and sorted(header.split(",")) == sorted(engines)   # picked one + the fallback
    mutation = {h.header.key: h.header.raw_value for h in responses[0].request_headers.response.header_mutation.set_headers}
    assert mutation["content-length"] == str(len(body)).encode()
    assert responses[0].request_headers.response.clear_route_cache
    streamed = [r.request_body.response.body_mutation.streamed_response for r in responses if r.HasField("request_body")]
    assert b"".join(s.body for s in streamed) == body and streamed[-1].end_of_stream
    echoed = [r.response_body.response.body_mutation.streamed_response for r in responses[-2:]]
    assert [e.body for e in echoed] == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"] and echoed[-1].end_of_stream


def test_a_shared_prefix_goes_where_it_is_cached(pool) -> None:
    engines, picker, _ = pool
    for tenant in (1, 2, 3):
        first = _destination(_exchange(picker, _request("/v1/chat/completions", _chat(tenant)))[0])[0].split(",")[0]
        chat = _chat(tenant)
        httpx.post(f"http://{first}/v1/chat/completions", json=chat, timeout=60).raise_for_status()
        time.sleep(0.6)   # the picker's next read of the engines' /kv/blocks
        chat["messages"][1]["content"] = "another question"
        again = _destination(_exchange(picker, _request("/v1/chat/completions", chat))[0])[0].split(",")[0]
        assert again == first


def test_the_subset_hint_limits_the_choice_and_an_empty_one_is_a_503(pool) -> None:
    engines, picker, _ = pool
    for engine in engines:
        responses = _exchange(picker, _request("/v1/completions", {"prompt": "subset", "max_tokens": 1},
                                               subset=[engine]))
        assert _destination(responses[0]) == (engine, engine)
    for subset in ([], ["10.9.9.9:8000"]):
        response = _exchange(picker, _request("/v1/completions", {"prompt": "x"}, subset=subset))[0]
        assert response.immediate_response.status.code == 503
        assert json.loads(response.immediate_response.body)["error"]["code"] == "no_ready_endpoint"


def test_buffered_mode_passes_headers_and_routes_on_the_body(pool) -> None:
    engines, picker, _ = pool
    responses = _exchange(picker, _request("/v1/completions", {"prompt": "buffered", "max_tokens": 1},
                                           mode=Mode.BUFFERED))
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    assert not responses[0].request_headers.response.HasField("header_mutation")
    common = responses[1].request_body.response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}[DESTINATION]
    assert header.split(",")[0] in engines and common.clear_route_cache
    assert not common.HasField("body_mutation")


def test_a_request_without_body_is_routed_on_its_headers(pool) -> None:
    engines, picker, _ = pool
    responses = _exchange(picker, [_headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)])
    assert _destination(responses[0])[0].split(",")[0] in engines


def test_bad_input_gets_clear_errors_and_the_picker_keeps_serving(pool) -> None:
    engines, picker, model = pool
    not_json = _exchange(picker, _request("/v1/completions", b"{not json"))[0].immediate_response
    assert not_json.status.code == 400 and "not JSON" in json.loads(not_json.body)["error"]["message"]
    array = _exchange(picker, _request("/v1/completions", b"[1, 2]"))[0].immediate_response
    assert array.status.code == 400
    time.sleep(1.0)   # the picker has read the engines' /v1/models
    unknown = _exchange(picker, _request("/v1/completions", {"model": "no-such-model", "prompt": "x"}))[0]
    error = json.loads(unknown.immediate_response.body)["error"]
    assert unknown.immediate_response.status.code == 404 and error["code"] == "model_not_found"
    assert "no-such-model" in error["message"]
    for broken in ([pb.ProcessingRequest()],                                       # nothing set
                   [pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))],  # no headers
                   _request("/v1/completions", {"prompt": "x"})[:1] * 2):          # headers twice
        with pytest.raises(grpc.RpcError) as refused:
            _exchange(picker, broken)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kubeinfer-epp" in refused.value.details()
    with grpc.insecure_channel(picker) as channel:   # undecodable bytes where a message belongs
        raw = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError):
            list(raw(iter([b"\xff\xff\xff garbage"]), timeout=5))
    fine = _exchange(picker, _request("/v1/completions", {"prompt": "still here", "max_tokens": 1}))
    assert _destination(fine[0])[0].split(",")[0] in engines


def test_no_ready_endpoint_is_a_503(tiny_model_path: str) -> None:
    with ExitStack() as stack:
        picker = _router([f"127.0.0.1:{free_port()}"], stack)   # nothing listens there
        response = _exchange(picker, _request("/v1/completions", {"prompt": "x"}))[0].immediate_response
        assert response.status.code == 503
        assert ("retry-after", "10") in [(h.header.key, h.header.raw_value.decode()) for h in response.headers.set_headers]


def test_every_endpoint_queued_past_the_limit_is_a_429(pool) -> None:
    engines, _, _ = pool
    with ExitStack() as stack:
        picker = _router(engines, stack, "--shed-queue-depth", "2")
        long = {"prompt": "queue", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        done = threading.Event()

        def occupy(engine: str) -> None:   # disconnects when done: the engine aborts it
            try:
                with httpx.stream("POST", f"http://{engine}/v1/completions", json=long, timeout=120) as stream:
                    for _ in stream.iter_lines():
                        if done.is_set():
                            return
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=occupy, args=(engine,), daemon=True) for engine in engines * 4]
        for thread in threads:   # each engine runs one and queues three
            thread.start()
        try:
            deadline = time.monotonic() + 30
            while True:
                response = _exchange(picker, _request("/v1/completions", {"prompt": "x", "max_tokens": 1}))[0]
                if response.HasField("immediate_response"):
                    break
                assert time.monotonic() < deadline, "never shed"
                time.sleep(0.2)
        finally:
            done.set()
        assert response.immediate_response.status.code == 429
        assert json.loads(response.immediate_response.body)["error"]["code"] == "overloaded"
        for thread in threads:
            thread.join(timeout=60)
