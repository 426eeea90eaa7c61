"""Cold start of `kubeinfer serve`: process spawn to /ready, and to the first streamed token.

Issue #4's target is spawn-to-first-token under 5 s on the embedded model. Each run starts the
venv's `kubeinfer serve` on 127.0.0.1 and a free port, polls /ready, streams one short
/v1/completions request, then sends SIGTERM and waits for the exit. Stages come from the
server's own log lines (the loader logs one line per stage with its timing), timed on arrival:

    python benchmarks/cold_start.py --runs 5 [--importtime] [--log] [-- extra serve flags]

A fresh pod also compiles the CPU C kernels at its first request (cached per machine): point
KUBEINFER_CACHE_DIR at an empty directory to include that in the first run.

A new replica on a node whose page cache does not hold the weights (issue #39):

    python benchmarks/cold_start.py --runs 3 --cold-page-cache DIR [--without-prefetch] -- --model DIR ...

drops DIR's weight files from the page cache before each run (as load_bandwidth.py does);
`--without-prefetch` runs the server with the weights' read-ahead during imports turned off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# (stage name, regex of the log line that ends it); a stage runs from the previous mark to its line.
_MARKS = (("read", re.compile(r"config and tokenizer read in ([\d.]+)s")),
          ("weights", re.compile(r"loaded \d+ tensors .* in ([\d.]+)s")),
          ("engine", re.compile(r"KV cache: ")),
          ("uvicorn", re.compile(r"Uvicorn running on")))


@dataclass
class Run:
    ready: float = 0.0
    first_token: float = 0.0
    cpu: float = 0.0          # the server's user+sys seconds up to its first token (robust to a busy host)
    load: float = 0.0         # 1-minute load average when the run started
    stages: dict[str, float] = field(default_factory=dict)
    log: list[tuple[float, str]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collect(stream, start: float, lines: list[tuple[float, str]]) -> None:
    for line in iter(stream.readline, ""):
        lines.append((time.perf_counter() - start, line.rstrip("\n")))


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /ready")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.01)
    raise TimeoutError(f"/ready not 200 within {timeout:.0f}s")


def _first_token(url: str, max_tokens: int) -> None:
    """Returns when the first SSE chunk carrying a generated token arrives (its text may be empty:
    a random-weight checkpoint's stand-in tokenizer cannot spell most of its tokens)."""
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": max_tokens, "stream": True,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                if any(choice.get("text") is not None for choice in json.loads(line[6:]).get("choices", [])):
                    return
    raise RuntimeError("stream ended without a token")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def _stages(run: Run) -> dict[str, float]:
    """Wall time per stage: 'start+imports' ends where the loader started reading the model."""
    stages, previous = {}, 0.0
    for name, pattern in _MARKS:
        hit = next(((at, m) for at, line in run.log if (m := pattern.search(line))), None)
        if hit is None:
            continue
        at, match = hit
        if name == "read":   # the log line comes after reading: split it from what came before
            stages["start+imports"] = at - float(match[1])
            previous = stages["start+imports"]
        stages[name] = at - previous
        previous = at
    stages["ready"] = run.ready - previous
    stages["first token"] = run.first_token - run.ready
    return stages


def one_run(command: list[str], port: int, max_tokens: int, timeout: float, env: dict[str, str]) -> Run:
    url = f"http://127.0.0.1:{port}"
    run = Run(load=os.getloadavg()[0])
    start = time.perf_counter()
    proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=_collect, args=(proc.stdout, start, run.log), daemon=True)
    reader.start()
    try:
        _wait_ready(url, proc, timeout)
        run.ready = time.perf_counter() - start
        _first_token(url, max_tokens)
        run.first_token = time.perf_counter() - start
        run.cpu = _cpu_seconds(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    run.stages = _stages(run)
    return run


def top_imports(log: list[tuple[float, str]], count: int) -> list[tuple[float, str]]:
    """Top-level modules by cumulative import time, from `-X importtime` lines in the log."""
    found = []
    for _, line in log:
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if match:   # depth 0: no leading spaces before the module name
            found.append((int(match[1]) / 1e6, match[2]))
    return sorted(found, reverse=True)[:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for /ready")
    parser.add_argument("--kubeinfer", default=str(Path(sys.executable).with_name("kubeinfer")),
                        help="the console script (default: the one beside this python)")
    parser.add_argument("--importtime", action="store_true",
                        help="one extra run under -X importtime; prints the slowest top-level imports")
    parser.add_argument("--log", action="store_true", help="print each run's server log")
    parser.add_argument("--cold-page-cache", type=Path, default=None, metavar="DIR",
                        help="drop DIR's .safetensors / .gguf files from the page cache before each run")
    parser.add_argument("--without-prefetch", action="store_true",
                        help="serve without reading the weights ahead during the imports (the A/B's before)")
    parser.add_argument("serve_args", nargs="*", help="extra `kubeinfer serve` flags (after --)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [args.kubeinfer, "serve", *args.serve_args]
    if args.without_prefetch:
        command = [sys.executable, "-c", "import sys; import kubeinfer.server.weights.prefetch as p; "
                   "p.prefetch = lambda model: None; from kubeinfer.server.cli import main; sys.exit(main())",
                   "serve", *args.serve_args]
    weight_files = sorted(p for p in args.cold_page_cache.iterdir() if p.suffix in (".safetensors", ".gguf")) \
        if args.cold_page_cache else []

    runs = []
    for index in range(args.runs):
        if weight_files:
            from load_bandwidth import cached_bytes, drop_from_page_cache

            drop_from_page_cache(weight_files)
            print(f"run {index + 1}: {cached_bytes(weight_files) >> 20} MB of the weights cached before", flush=True)
        run = one_run(command, free_port(), args.max_tokens, args.timeout, env)
        runs.append(run)
        stages = "  ".join(f"{name} {seconds:.2f}" for name, seconds in run.stages.items())
        print(f"run {index + 1}: ready {run.ready:.2f}s  first token {run.first_token:.2f}s  "
              f"(cpu {run.cpu:.2f}s, load {run.load:.1f})  |  {stages}", flush=True)
        if args.log:
            print("\n".join(f"  {at:7.3f} {line}" for at, line in run.log))
    print(f"median of {len(runs)}: ready {statistics.median(r.ready for r in runs):.2f}s  "
          f"first token {statistics.median(r.first_token for r in runs):.2f}s  "
          f"cpu {statistics.median(r.cpu for r in runs):.2f}s")
    names = list(dict.fromkeys(name for run in runs for name in run.stages))
    print("median stages: " + "  ".join(
        f"{name} {statistics.median(run.stages.get(name, 0.0) for run in runs):.2f}" for name in names))
    print("weights line:", next((line.split(": ", 1)[1] for _, line in runs[-1].log
                                 if _MARKS[1][1].search(line)), "?"))

    if args.importtime:
        run = one_run(command, free_port(), args.max_tokens, args.timeout,
                      {**env, "PYTHONPROFILEIMPORTTIME": "1"})
        print("slowest top-level imports (cumulative, under -X importtime):")
        for seconds, module in top_imports(run.log, 12):
            print(f"  {seconds:6.3f}s {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
