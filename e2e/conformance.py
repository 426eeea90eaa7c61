"""A model-server and endpoint-picker conformance suite for Gateway API Inference Extension use.

    python -m e2e.conformance --engine http://127.0.0.1:8000 \\
        [--kv-events tcp://127.0.0.1:5557 --kv-replay tcp://127.0.0.1:5558] [--epp 127.0.0.1:9002]

Runs against any OpenAI-compatible engine (kubeinfer, vLLM, ...) and prints one line per item:
PASS, FAIL (with why) or SKIP (an optional part not given). Exit status 1 when any item fails.

- metrics: GIE's model-server protocol (proposal 003) with vLLM's names and types, and their
  meaning (a running request shows in `num_requests_running` and `kv_cache_usage_perc`, and leaves).
- openai: what a gateway relies on: model listing, usage, streaming that ends with [DONE] and a
  usage chunk, OpenAI error objects for bad requests, and a request aborted when its client
  disconnects (the engine's running count drops back).
- kv-events: vLLM's ZMQ KV events (msgpack batches, sequence numbers, BlockStored for a prompt,
  the replay socket), when `--kv-events` is given. Both of vLLM's wire forms are read (events as
  tagged arrays or as maps; replay replies with or without the topic frame); the detail says which.
- epp: GIE's endpoint-picker protocol over ext_proc (proposal 004), when `--epp` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

import httpx

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@dataclass
class Result:
    item: str
    status: str   # PASS, FAIL, SKIP
    detail: str = ""


class Failed(AssertionError):
    pass


def check(condition: bool, why: str) -> None:
    if not condition:
        raise Failed(why)


def parse_metrics(text: str) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """(type by family, samples by name) from Prometheus text, with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return types, samples


KV_EVENT_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                   "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}


def kv_event(event: object) -> tuple[str, dict]:
    """(kind, fields) of one KV event in either of vLLM's msgpack forms: a tagged array
    `["BlockStored", block_hashes, parent, token_ids, block_size, ...]` (vLLM's array_like events,
    which kubeinfer publishes) or a map tagged by "type" (vLLM 0.32's)."""
    if isinstance(event, dict):
        kind = event.get("type")
        names = KV_EVENT_FIELDS.get(kind, ())
        check(all(name in event for name in names), f"{kind} map without {names}: {sorted(event)}")
        return kind, {name: event[name] for name in names}
    check(isinstance(event, list) and event, f"event layout {event!r:.80}")
    kind, names = event[0], KV_EVENT_FIELDS.get(event[0], ())
    check(len(event) > len(names), f"{kind} array of {len(event)} items")
    return kind, dict(zip(names, event[1:]))


class Suite:
    def __init__(self, engine: str, model: str | None, kv_events: str | None, kv_replay: str | None,
                 epp: str | None, timeout: float = 60.0) -> None:
        self.engine, self.kv_events, self.kv_replay, self.epp = engine.rstrip("/"), kv_events, kv_replay, epp
        self.http = httpx.Client(base_url=self.engine, timeout=timeout)
        self.model = model or self.http.get("/v1/models").json()["data"][0]["id"]
        self.results: list[Result] = []

    def run(self, item: str, test: Callable[[], str | None], needs: object = True) -> None:
        if not needs:
            self.results.append(Result(item, "SKIP", "not configured"))
            return
        try:
            self.results.append(Result(item, "PASS", test() or ""))
        except Exception as error:  # noqa: BLE001 - every item reports, whatever it hit
            self.results.append(Result(item, "FAIL", f"{type(error).__name__}: {error}"))

    def gauge(self, name: str) -> float:
        return sum(v for _, v in parse_metrics(self.http.get("/metrics").text)[1].get(name, []))

    def wait_for(self, condition: Callable[[], bool], seconds: float = 10.0) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.1)
        return False

    # -- metrics -----------------------------------------------------------------------------

    def metric_types(self) -> str:
        types, samples = parse_metrics(self.http.get("/metrics").text)
        for name in GAUGES:
            check(types.get(name) == "gauge", f"{name}: type {types.get(name)!r}, want gauge")
            check(name in samples, f"{name}: no sample")
        usage = self.gauge("vllm:kv_cache_usage_perc")
        check(0.0 <= usage <= 1.0, f"vllm:kv_cache_usage_perc {usage} outside 0..1")
        return ", ".join(GAUGES)

    def cache_config_info(self) -> str:
        types, samples = parse_metrics(self.http.get("/metrics").text)
        check("vllm:cache_config_info" in samples, "vllm:cache_config_info absent")
        labels = samples["vllm:cache_config_info"][0][0]
        check(labels.get("block_size", "").isdigit(), f"no numeric block_size label: {labels}")
        return f"block_size={labels['block_size']}"

    def running_semantics(self) -> str:
        """A streaming request shows as running and holding KV, and leaves when it ends."""
        check(self.wait_for(lambda: self.gauge("vllm:num_requests_running") == 0),
              "the engine is not idle before the check")
        body = {"model": self.model, "prompt": "count " * 64, "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with self.http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            running, usage = self.gauge("vllm:num_requests_running"), self.gauge("vllm:kv_cache_usage_perc")
        check(running >= 1, f"num_requests_running {running} while a request streams")
        check(usage > 0, f"kv_cache_usage_perc {usage} while a request holds KV")
        check(self.wait_for(lambda: self.gauge("vllm:num_requests_running") == 0),
              "num_requests_running did not return to 0 after the client left (no abort on disconnect?)")
        return f"running {running:g}, kv usage {usage:.4f} mid-request; 0 running after disconnect"

    # -- OpenAI surface ----------------------------------------------------------------------

    def models(self) -> str:
        data = self.http.get("/v1/models").json()["data"]
        check(any(card["id"] == self.model for card in data), f"{self.model} not listed")
        return self.model

    def usage(self) -> str:
        body = {"model": self.model, "prompt": "Hello there, how are", "max_tokens": 3}
        answer = self.http.post("/v1/completions", json=body)
        check(answer.status_code == 200, f"status {answer.status_code}: {answer.text[:200]}")
        usage = answer.json()["usage"]
        check(usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, f"usage {usage}")
        check(usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"usage {usage}")
        return json.dumps(usage)

    def streaming(self) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}
        chunks, done = [], False
        with self.http.stream("POST", "/v1/chat/completions", json=body) as stream:
            check(stream.status_code == 200, f"status {stream.status_code}")
            check(stream.headers.get("content-type", "").startswith("text/event-stream"), "not text/event-stream")
            for line in stream.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
        check(done, "no data: [DONE]")
        check(any(c.get("choices") and c["choices"][0].get("delta") for c in chunks), "no delta chunk")
        check(chunks and chunks[-1].get("usage", {}).get("completion_tokens", 0) > 0, "no final usage chunk")
        return f"{len(chunks)} chunks, usage {chunks[-1]['usage']}"

    def errors(self) -> str:
        cases = [({"model": "no-such-model-xyz", "prompt": "x", "max_tokens": 1}, 404),
                 ({"model": self.model, "prompt": "x", "max_tokens": -1}, 400),
                 ({"model": self.model}, 400)]
        for body, status in cases:
            answer = self.http.post("/v1/completions", json=body)
            check(answer.status_code == status, f"{body}: status {answer.status_code}, want {status}")
            error = answer.json().get("error")
            check(isinstance(error, dict) and error.get("message") and "type" in error,
                  f"{body}: not an OpenAI error object: {answer.text[:200]}")
        answer = self.http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        check(answer.status_code == 400 and "error" in answer.json(), f"non-JSON body: {answer.status_code}")
        return "404 unknown model, 400 bad max_tokens / missing prompt / not JSON"

    # -- KV events ---------------------------------------------------------------------------

    def kv_event_stream(self) -> str:
        import msgpack
        import zmq

        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.kv_events)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        try:
            seqs, stored, prompt, forms = [], [], list(range(100, 100 + 130)), set()
            for attempt in range(30):   # PUB drops what it sends before the subscription arrives
                warm = {"model": self.model, "prompt": [[attempt + 400] * 40], "max_tokens": 1}
                self.http.post("/v1/completions", json=warm)
                if poller.poll(300):
                    break
            while poller.poll(300):
                sub.recv_multipart()
            self.http.post("/v1/completions", json={"model": self.model, "prompt": [prompt], "max_tokens": 1})
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and poller.poll(500):
                topic, seq, payload = sub.recv_multipart()
                check(len(seq) == 8, f"sequence frame of {len(seq)} bytes")
                seqs.append(int.from_bytes(seq, "big"))
                batch = msgpack.unpackb(payload)
                check(isinstance(batch, list) and isinstance(batch[0], float), f"batch layout {batch!r:.80}")
                for event in batch[1]:
                    kind, fields = kv_event(event)
                    forms.add("maps" if isinstance(event, dict) else "arrays")
                    check(kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"), f"event {kind!r}")
                    if kind == "BlockStored":
                        stored.append(fields)
            check(stored, "no BlockStored after a 130-token prompt")
            tokens = [t for event in stored for t in event["token_ids"]]
            check(tokens and all(t in prompt for t in tokens), "BlockStored token_ids not from the prompt")
            check(seqs == sorted(seqs) and len(set(seqs)) == len(seqs), f"sequence numbers {seqs}")
            return (f"{len(stored)} BlockStored, block_size {stored[0]['block_size']}, seq {seqs[0]}..{seqs[-1]}; "
                    f"events as tagged {' and '.join(sorted(forms))}")
        finally:
            sub.close(0)
            context.term()

    def replay(self) -> str:
        import zmq

        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(self.kv_replay)
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replies, layouts = 0, set()
            while True:
                frames = dealer.recv_multipart()
                # [b"", seq, payload]; vLLM 0.32 puts the topic before seq: [b"", topic, seq, payload]
                check(len(frames) in (3, 4) and frames[0] == b"", f"reply of {len(frames)} frames")
                layouts.add("with the topic frame" if len(frames) == 4 else "without a topic frame")
                seq, payload = frames[-2], frames[-1]
                if int.from_bytes(seq, "big", signed=True) == -1:
                    check(payload == b"", "end marker with a payload")
                    break
                replies += 1
            check(replies > 0, "replay returned no batch")
            return f"{replies} batches replayed, then the end marker; {' and '.join(sorted(layouts))}"
        finally:
            dealer.close(0)
            context.term()

    # -- endpoint picker ---------------------------------------------------------------------

    def epp_health(self) -> str:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.epp) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                check(status == health_pb2.HealthCheckResponse.SERVING, f"{service}: {status}")
        return "liveness, readiness, ext_proc: SERVING"

    def epp_exchange(self, body: bytes, subset: list[str] | None = None) -> list:
        import grpc
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
        from google.protobuf import struct_pb2

        headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
            ((":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json"))])))
        if subset is not None:
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": subset})
            headers.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        messages = [headers, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
        with grpc.insecure_channel(self.epp) as channel:
            return list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))

    def epp_destination(self) -> str:
        body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 1}).encode()
        first = self.epp_exchange(body)[0]
        mutation = {h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
                    for h in first.request_headers.response.header_mutation.set_headers}
        header = mutation.get("x-gateway-destination-endpoint")
        metadata = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value
        check(header and header == metadata, f"header {header!r} vs envoy.lb metadata {metadata!r}")
        check(all(":" in endpoint for endpoint in header.split(",")), f"not ip:port: {header}")
        return header

    def epp_refusals(self) -> str:
        subset = self.epp_exchange(b'{"prompt": "x"}', subset=["192.0.2.1:1"])[0]
        check(subset.immediate_response.status.code == 503, "a subset of no ready endpoint: not 503")
        bad = self.epp_exchange(b"{not json")[0]
        check(bad.immediate_response.status.code == 400, f"non-JSON body: {bad.WhichOneof('response')}")
        return "503 for an empty subset, 400 for a non-JSON body"


def run_suite(args: argparse.Namespace) -> list[Result]:
    suite = Suite(args.engine, args.model, args.kv_events, args.kv_replay, args.epp,
                  timeout=getattr(args, "timeout", 60.0))
    suite.run("metrics: GIE gauges with vLLM's names and types", suite.metric_types)
    suite.run("metrics: vllm:cache_config_info block_size", suite.cache_config_info)
    suite.run("metrics: running / KV usage follow a request", suite.running_semantics)
    suite.run("openai: /v1/models lists the model", suite.models)
    suite.run("openai: usage on completions", suite.usage)
    suite.run("openai: chat streaming, [DONE], usage chunk", suite.streaming)
    suite.run("openai: OpenAI error objects", suite.errors)
    suite.run("kv-events: ZMQ batches, seq, BlockStored", suite.kv_event_stream, args.kv_events)
    suite.run("kv-events: replay socket", suite.replay, args.kv_replay)
    suite.run("epp: gRPC health", suite.epp_health, args.epp)
    suite.run("epp: destination header = envoy.lb metadata", suite.epp_destination, args.epp)
    suite.run("epp: 503 empty subset, 400 non-JSON", suite.epp_refusals, args.epp)
    return suite.results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, help="the engine's base URL (OpenAI API and /metrics)")
    parser.add_argument("--model", help="model name to use (default: the first of /v1/models)")
    parser.add_argument("--kv-events", help="the engine's KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--kv-replay", help="its replay (ROUTER) endpoint")
    parser.add_argument("--epp", help="an endpoint picker's ext_proc address host:port")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds an HTTP request to the engine may take (raise it on a loaded machine)")
    results = run_suite(parser.parse_args(argv))
    for result in results:
        print(f"{result.status:4}  {result.item}" + (f"  ({result.detail})" if result.detail else ""))
    failed = sum(r.status == "FAIL" for r in results)
    print(f"{len(results) - failed - sum(r.status == 'SKIP' for r in results)} passed, {failed} failed, "
          f"{sum(r.status == 'SKIP' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
