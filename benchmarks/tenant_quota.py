"""Quotas across two router replicas, measured (issue #42: "over a 3-minute run, the tokens
admitted per tenant match the quota within +-2%, across 2 router replicas; refusals are 429
with Retry-After").

Starts one `kubeinfer serve` (a tiny random-weight Llama: this measures accounting, not speed)
and two `kubeinfer route` processes in front of it with the same `--tenants-file` and
`--quota-replicas 2`. Each tenant's clients spread their requests over both routers (one
client in two on each, as a Service spreads connections) and keep asking beyond the quota for
`--seconds`: on a 429 a client checks its Retry-After and asks again after `--retry-pause`
(shorter than Retry-After, so demand never lets a bucket rest). Each request asks for
`max_tokens` with `ignore_eos`, so the router's estimate (body bytes / 4 + max_tokens) is close
to what the answer uses.

Reports per tenant: tokens admitted (the `usage.total_tokens` of the requests answered 200
that were sent within the window) against quota x minutes, the ratio, requests admitted
against a requests-per-minute quota, and refusals (all must be 429 with Retry-After).

    python benchmarks/tenant_quota.py --seconds 180
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.tiny_models import make_tiny_llama  # noqa: E402

# name -> (key, tokens per minute, requests per minute, clients)
TENANTS = {
    "team-a": ("sk-team-a", 12000, None, 12),
    "team-b": ("sk-team-b", 4800, None, 8),
    "team-c": ("sk-team-c", None, 120, 6),
}
PROMPT = "Summarise the quarterly report for the team."   # about a dozen tokens
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str], log: Path, stack: ExitStack) -> str:
    port = free_port()
    handle = stack.enter_context(open(log, "w"))
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", *args, "--port", str(port)],
                               stdout=handle, stderr=subprocess.STDOUT, env=os.environ.copy())
    stack.callback(lambda: (process.terminate(), process.wait(timeout=60)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    probe = "/ready" if args[0] == "serve" else "/healthz"
    while True:
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{' '.join(args[:1])} did not start: see {log}")
        time.sleep(0.5)


async def tenant(name: str, key: str, clients: int, routers: list[str], model: str, window: float,
                 retry_pause: float) -> dict:
    """Closed-loop clients of one tenant, client i on router i % 2, until `window` seconds pass."""
    admitted_tokens = admitted_requests = 0
    refusals: Counter[str] = Counter()
    bad: list[str] = []
    start = time.monotonic()
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}

    async def client(index: int) -> None:
        nonlocal admitted_tokens, admitted_requests
        async with httpx.AsyncClient(base_url=routers[index % len(routers)], timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            while time.monotonic() - start < window:
                reply = await http.post("/v1/completions", json=body)
                if reply.status_code == 200:
                    admitted_tokens += reply.json()["usage"]["total_tokens"]
                    admitted_requests += 1
                elif reply.status_code == 429 and "retry-after" in reply.headers:
                    refusals[reply.headers.get("x-kubeinfer-rate-limit", "?")] += 1
                    await asyncio.sleep(retry_pause)
                else:
                    bad.append(f"{reply.status_code} {reply.text[:120]} {dict(reply.headers)}")
                    await asyncio.sleep(retry_pause)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"tenant": name, "admitted_tokens": admitted_tokens, "admitted_requests": admitted_requests,
            "refused_429_with_retry_after": dict(refusals), "other_answers": len(bad), "first_other": bad[:3]}


async def run(routers: list[str], model: str, window: float, retry_pause: float) -> list[dict]:
    return list(await asyncio.gather(*(tenant(name, key, clients, routers, model, window, retry_pause)
                                       for name, (key, _, _, clients) in TENANTS.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--retry-pause", type=float, default=0.2, help="seconds a refused client waits")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "tenant-quota")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    table = {"tenants": [{"name": name, "keys": [key],
                          "quotas": {k: v for k, v in (("tokens_per_minute", tpm), ("requests_per_minute", rpm)) if v}}
                         for name, (key, tpm, rpm, _) in TENANTS.items()]}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model = make_tiny_llama(workdir / "model")
        tenants_file = workdir / "tenants.json"
        tenants_file.write_text(json.dumps(table))
        engine = start(["serve", "--model", str(model), "--dtype", "float32", "--max-num-seqs", "32"],
                       args.logs / "engine.log", stack)
        route = ["route", "--backend", engine, "--tenants-file", str(tenants_file), "--quota-replicas", "2",
                 "--strategy", "least-load"]
        routers = [start(route, args.logs / f"router-{i}.log", stack) for i in range(2)]
        print("engine: kubeinfer serve --model <tiny llama> --dtype float32 --max-num-seqs 32", flush=True)
        print(f"routers (2): kubeinfer {' '.join(route[:1] + route[3:])}", flush=True)
        print(f"tenants: {json.dumps(table['tenants'])}", flush=True)
        served = httpx.get(f"{engine}/v1/models", timeout=10).json()["data"][0]["id"]
        started = time.monotonic()
        results = asyncio.run(run(routers, served, args.seconds, args.retry_pause))
        elapsed = time.monotonic() - started
    minutes = args.seconds / 60
    print(f"window {args.seconds:g} s (last answers in by {elapsed:.1f} s)", flush=True)
    for result in results:
        _, tpm, rpm, _ = TENANTS[result["tenant"]]
        print(json.dumps(result), flush=True)
        if tpm:
            quota = tpm * minutes
            print(f"{result['tenant']}: tokens admitted {result['admitted_tokens']} / quota {quota:g} "
                  f"({tpm}/min x {minutes:g}) = {result['admitted_tokens'] / quota:.4f}", flush=True)
        if rpm:
            quota = rpm * minutes
            print(f"{result['tenant']}: requests admitted {result['admitted_requests']} / quota {quota:g} "
                  f"({rpm}/min x {minutes:g}) = {result['admitted_requests'] / quota:.4f}", flush=True)
        refused = sum(result["refused_429_with_retry_after"].values())
        print(f"{result['tenant']}: refusals {refused}, all 429 with Retry-After: {result['other_answers'] == 0}",
              flush=True)


if __name__ == "__main__":
    main()
