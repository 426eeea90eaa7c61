"""Fair queuing and priority at the engine, measured on one `kubeinfer serve` (docs/tenancy.md).

Starts `kubeinfer serve --max-num-seqs 8 --trust-tenant-header` (the fair policy) and runs,
against that one server:

- `alone`: tenant B's short requests, one at a time, with nothing else running;
- `fcfs`: tenant A keeps 32 streaming requests in flight (16-64 output tokens each) while B
  sends its short requests one at a time; neither sends a tenant header, so both are one
  anonymous tenant and the scheduler's order is arrival (today's FCFS);
- `fair`: the same, with A and B named by `x-gateway-inference-fairness-id`;
  `--rounds N` runs `fcfs` and `fair` N times each in ABBA order (fcfs fair, fair fcfs, ...), so
  a machine whose speed drifts weighs on both alike;
- `tenfold` (with `--tenfold-seconds S`): tenant A runs 10 closed-loop streams, tenant B one, all
  requests of one shape (16-64 output tokens), for S seconds each: B alone, A alone, both with
  no tenant header (FCFS) and both named (fair), the last two in ABBA order over the rounds;
- `priority`: 32 workers saturate the engine, every fourth request with priority 0 (high),
  the others priority 10 (low); TTFT per class, and every low-priority request's latency.

Prints one JSON line per phase and a summary. B's TTFT p99 in `fair` against `fcfs` is the
acceptance ratio of issue #42 (<= 0.3); A's output tok/s in `fair` against `fcfs` shows what
fairness costs A, next to B's share of the tokens. In `tenfold`, B's TTFT p99 with A against B's
alone (#42: within 20% when fair), and A's tok/s with B against A's alone minus B's share.

    python benchmarks/tenant_fairness.py --b-requests 30 --priority-requests 120 --rounds 2 --tenfold-seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx

A_IN_FLIGHT = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest rank (with few samples p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


async def stream(client: httpx.AsyncClient, max_tokens: int, headers: dict[str, str],
                 prompt: str, priority: int | None = None) -> tuple[float, float, int]:
    """(TTFT, end-to-end seconds, output tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    if priority is not None:
        body["priority"] = priority
    start, first, tokens = time.monotonic(), None, 0
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    first = first or time.monotonic()
                    tokens += 1
    end = time.monotonic()
    return (first or end) - start, end - start, tokens


async def phase(client: httpx.AsyncClient, name: str, b_requests: int, with_a: bool, tagged: bool,
                rng: random.Random) -> dict:
    a_headers = {"x-gateway-inference-fairness-id": "tenant-a"} if tagged else {}
    b_headers = {"x-gateway-inference-fairness-id": "tenant-b"} if tagged else {}
    stop = asyncio.Event()
    a_tokens = [0]

    async def a_worker(index: int) -> None:
        while not stop.is_set():
            _, _, tokens = await stream(client, rng.randint(16, 64), a_headers, f"Tenant A job {index}: write a story.")
            a_tokens[0] += tokens

    workers = [asyncio.ensure_future(a_worker(i)) for i in range(A_IN_FLIGHT)] if with_a else []
    if with_a:
        await asyncio.sleep(5)   # A's 32 requests queued and running before B measures
    a_start, a_start_tokens = time.monotonic(), a_tokens[0]
    b_ttft, b_tokens = [], 0
    for i in range(b_requests):
        ttft, _, tokens = await stream(client, 4, b_headers, f"Tenant B question {i}: hi")
        b_ttft.append(ttft)
        b_tokens += tokens
    elapsed = time.monotonic() - a_start
    a_done = a_tokens[0] - a_start_tokens
    stop.set()
    if workers:
        await asyncio.gather(*workers)
    return {"phase": name, "b_requests": b_requests, "b_ttft_p50": percentile(b_ttft, 50),
            "b_ttft_p99": percentile(b_ttft, 99), "b_ttft_max": max(b_ttft), "seconds": round(elapsed, 1),
            "a_tok_per_s": round(a_done / elapsed, 1), "b_tok_per_s": round(b_tokens / elapsed, 2),
            "b_token_share": round(b_tokens / max(1, a_done + b_tokens), 4)}


async def priority_phase(client: httpx.AsyncClient, total: int, rng: random.Random) -> dict:
    queue = list(range(total))
    results: dict[int, list[tuple[float, float]]] = {0: [], 10: []}

    async def worker() -> None:
        while queue:
            index = queue.pop(0)
            priority = 0 if index % 4 == 0 else 10
            ttft, e2e, _ = await stream(client, rng.randint(16, 64), {}, f"Job {index}: write a story.", priority)
            results[priority].append((ttft, e2e))

    await asyncio.gather(*(worker() for _ in range(A_IN_FLIGHT)))
    high, low = [t for t, _ in results[0]], [t for t, _ in results[10]]
    return {"phase": "priority", "high": len(high), "low": len(low),
            "high_ttft_p99": percentile(high, 99), "low_ttft_p99": percentile(low, 99),
            "high_ttft_p50": percentile(high, 50), "low_ttft_p50": percentile(low, 50),
            "low_e2e_max": max(e for _, e in results[10]), "low_finished": len(results[10])}


async def streams_for(client: httpx.AsyncClient, seconds: float, workers: dict[str, int], tagged: bool,
                      rng: random.Random) -> dict[str, dict]:
    """Closed-loop streams per tenant, each starting requests until `seconds` have passed (and
    finishing the one it is in): each tenant's TTFTs and output tok/s over the whole phase."""
    deadline = time.monotonic() + seconds
    ttfts: dict[str, list[float]] = {tenant: [] for tenant in workers}
    tokens = dict.fromkeys(workers, 0)

    async def worker(tenant: str, index: int) -> None:
        headers = {"x-gateway-inference-fairness-id": tenant} if tagged else {}
        while time.monotonic() < deadline:
            ttft, _, count = await stream(client, rng.randint(16, 64), headers, f"{tenant} job {index}: write a story.")
            ttfts[tenant].append(ttft)
            tokens[tenant] += count

    start = time.monotonic()
    await asyncio.gather(*(worker(tenant, i) for tenant, count in workers.items() for i in range(count)))
    elapsed = time.monotonic() - start
    return {tenant: {"requests": len(ttfts[tenant]), "ttft_p50": percentile(ttfts[tenant], 50),
                     "ttft_p99": percentile(ttfts[tenant], 99), "tok_per_s": round(tokens[tenant] / elapsed, 2)}
            for tenant in workers}


async def tenfold(client: httpx.AsyncClient, seconds: float, rounds: int, rng: random.Random) -> None:
    """Tenant A at ten times tenant B's load (10 closed-loop streams against 1), both streaming."""
    b_alone = (await streams_for(client, seconds, {"tenant-b": 1}, True, rng))["tenant-b"]
    print(json.dumps({"phase": "tenfold-b-alone", **b_alone}), flush=True)
    a_alone = (await streams_for(client, seconds, {"tenant-a": 10}, True, rng))["tenant-a"]
    print(json.dumps({"phase": "tenfold-a-alone", **a_alone}), flush=True)
    for index in range(rounds):
        order = ((False, "fcfs"), (True, "fair")) if index % 2 == 0 else ((True, "fair"), (False, "fcfs"))
        for tagged, name in order:
            both = await streams_for(client, seconds, {"tenant-a": 10, "tenant-b": 1}, tagged, rng)
            a, b = both["tenant-a"], both["tenant-b"]
            share = b["tok_per_s"] / max(1e-9, a["tok_per_s"] + b["tok_per_s"])
            print(json.dumps({"phase": f"tenfold-{name}", "round": index + 1, "a": a, "b": b}), flush=True)
            print(f"tenfold round {index + 1} {name}: B TTFT p99 {b['ttft_p99']:.3f} s = "
                  f"{b['ttft_p99'] / b_alone['ttft_p99']:.3f}x alone ({b_alone['ttft_p99']:.3f} s); "
                  f"A tok/s {a['tok_per_s']} = {a['tok_per_s'] / a_alone['tok_per_s']:.3f}x alone "
                  f"({a_alone['tok_per_s']}), against (1 - B's share {share:.3f}) x 0.9 = {(1 - share) * 0.9:.3f}",
                  flush=True)


async def run(url: str, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await stream(client, 4, {}, "warm up")
        alone = await phase(client, "alone", args.b_requests, False, False, rng)
        print(json.dumps(alone), flush=True)
        rounds: list[dict[str, dict]] = []
        for index in range(args.rounds):
            order = (("fcfs", False), ("fair", True)) if index % 2 == 0 else (("fair", True), ("fcfs", False))
            results = {}
            for name, tagged in order:
                results[name] = await phase(client, name, args.b_requests, True, tagged, rng)
                print(json.dumps({"round": index + 1, **results[name]}), flush=True)
            rounds.append(results)
        if args.priority_requests:
            result = await priority_phase(client, args.priority_requests, rng)
            print(json.dumps(result), flush=True)
            print(f"priority: high TTFT p99 / low TTFT p99 = {result['high_ttft_p99'] / result['low_ttft_p99']:.3f}; "
                  f"slowest low-priority request {result['low_e2e_max']:.1f} s", flush=True)
        for index, results in enumerate(rounds, 1):
            fcfs, fair = results["fcfs"], results["fair"]
            print(f"round {index}: B TTFT p99: fair {fair['b_ttft_p99']:.3f} s / fcfs {fcfs['b_ttft_p99']:.3f} s = "
                  f"{fair['b_ttft_p99'] / fcfs['b_ttft_p99']:.3f} (alone {alone['b_ttft_p99']:.3f} s); "
                  f"A tok/s: fair {fair['a_tok_per_s']} / fcfs {fcfs['a_tok_per_s']} = "
                  f"{fair['a_tok_per_s'] / fcfs['a_tok_per_s']:.3f}, A's loss {1 - fair['a_tok_per_s'] / fcfs['a_tok_per_s']:.4f} "
                  f"against B's token share {fair['b_token_share']:.4f} (fcfs {fcfs['b_token_share']:.4f})", flush=True)
        if args.tenfold_seconds:
            await tenfold(client, args.tenfold_seconds, args.rounds, rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--b-requests", type=int, default=30)
    parser.add_argument("--priority-requests", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=1, help="fcfs/fair pairs, in ABBA order")
    parser.add_argument("--tenfold-seconds", type=float, default=0, help="each phase of the 10x load scenario; 0: skip it")
    parser.add_argument("--url", help="an already running server (started with --trust-tenant-header)")
    args = parser.parse_args()
    if args.url:
        asyncio.run(run(args.url, args))
        return
    port = free_port()
    command = [sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-num-seqs", "8", "--trust-tenant-header"]
    print("server:", " ".join(command[2:]), flush=True)
    server = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr, env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not become ready")
            time.sleep(0.5)
        asyncio.run(run(url, args))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
