"""What OpenTelemetry tracing costs the engine, and how much of a request its spans cover (#42).

Starts two `kubeinfer serve` processes with the same flags, one with `--otlp-traces-endpoint`
pointing at an OTLP/HTTP receiver in this process (every request sampled), one without, both up
at once, and:

1. throughput: `kubeinfer bench serve` (random token prompts, `--ignore-eos`) against each in
   ABBA order over the rounds (traced first in odd rounds, plain first in even ones), so a
   machine whose speed drifts weighs on both alike; prints each run's output tok/s and the
   traced / plain ratio per pair of rounds;
2. coverage: sequential requests to the traced server from one kept-alive client, each under its
   own W3C `traceparent`; the client's time from sending the request to reading the last byte,
   against the `llm_request` span the engine exports for it.

    python benchmarks/tracing_cost.py --rounds 4 --num-prompts 64 --concurrency 16 --coverage-requests 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers.otlp import OtlpReceiver  # noqa: E402  (benchmark infrastructure, not product)
from tests.helpers.serve_process import free_port, wait_until_ready  # noqa: E402


def serve(args: list[str], stack: ExitStack, log: Path) -> str:
    port = free_port()
    handle = stack.enter_context(log.open("w"))
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", "serve", *args, "--port", str(port)],
                               stdout=handle, stderr=subprocess.STDOUT, env=os.environ.copy())
    stack.callback(lambda: (process.terminate(), process.wait(timeout=60)))
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, url, timeout=600)
    return url


def bench(url: str, args: argparse.Namespace, seed: int, out: Path) -> float:
    """Output tok/s of one `kubeinfer bench serve` run."""
    subprocess.run([sys.executable, "-m", "kubeinfer.server.cli", "bench", "serve", "--base-url", url,
                    "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency),
                    "--ignore-eos", "--seed", str(seed), "--no-progress", "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["levels"][0]["output_throughput"]


def coverage(url: str, receiver: OtlpReceiver, count: int, output_len: int) -> list[float]:
    """Per request: the `llm_request` span's duration / the client's time for it."""
    client_seconds: dict[str, float] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 4})
        for index in range(count):
            trace_id = f"{index + 0x1000:032x}"
            body = {"prompt": f"Request {index}: tell a story.", "max_tokens": output_len, "ignore_eos": True}
            start = time.perf_counter()
            reply = client.post("/v1/completions", json=body, headers={"traceparent": f"00-{trace_id}-{1:016x}-01"})
            reply.read()
            client_seconds[trace_id] = time.perf_counter() - start
            reply.raise_for_status()
    deadline = time.monotonic() + 60   # the engine exports in batches, every few seconds
    while True:
        spans = {span.trace_id.hex(): span for span in receiver.spans if span.name == "llm_request"}
        if set(client_seconds) <= set(spans) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    missing = set(client_seconds) - set(spans)
    if missing:
        raise SystemExit(f"{len(missing)} requests' llm_request spans never arrived")
    return [(spans[t].end_time_unix_nano - spans[t].start_time_unix_nano) / 1e9 / seconds
            for t, seconds in client_seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="what both servers serve")
    parser.add_argument("--rounds", type=int, default=4, help="benchmark runs per server, in ABBA order")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per benchmark run")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per benchmark run")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (random token ids)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens of every request")
    parser.add_argument("--coverage-requests", type=int, default=20,
                        help="sequential traced requests whose spans are compared with the client's time")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()), help="the servers' logs go here")
    args = parser.parse_args()
    receiver = OtlpReceiver()
    common = ["--model", args.model, "--max-num-seqs", str(max(32, args.concurrency)), "--log-level", "warning"]
    with ExitStack() as stack:
        urls = {"traced": serve([*common, "--otlp-traces-endpoint", receiver.url,
                                 "--otlp-traces-sampling-ratio", "1.0"], stack, args.logs / "tracing-traced.log"),
                "plain": serve(common, stack, args.logs / "tracing-plain.log")}
        print("servers:", json.dumps(urls), "receiver:", receiver.url, flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            for name, url in urls.items():   # one unmeasured burst each
                bench(url, argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}), 0,
                      Path(scratch) / f"warm-{name}.json")
            results: dict[str, list[float]] = {"traced": [], "plain": []}
            for index in range(args.rounds):
                order = ("traced", "plain") if index % 2 == 0 else ("plain", "traced")
                for name in order:
                    tok_s = bench(urls[name], args, index + 1, Path(scratch) / f"{name}-{index}.json")
                    results[name].append(tok_s)
                    print(f"round {index + 1} {name}: {tok_s:.1f} output tok/s", flush=True)
        ratios = [t / p for t, p in zip(results["traced"], results["plain"])]
        print("traced / plain per round:", ", ".join(f"{r:.3f}" for r in ratios),
              f"(median {statistics.median(ratios):.3f}; spans exported: {len(receiver.spans)})", flush=True)
        shares = coverage(urls["traced"], receiver, args.coverage_requests, args.output_len)
        print(f"llm_request span / client time over {len(shares)} sequential requests of {args.output_len} tokens: "
              f"min {min(shares):.4f}, median {statistics.median(shares):.4f}, max {max(shares):.4f}", flush=True)


if __name__ == "__main__":
    main()
