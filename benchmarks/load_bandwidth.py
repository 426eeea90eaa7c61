"""Safetensors load bandwidth against the disk's sequential read bandwidth, in the same run.

    python benchmarks/load_bandwidth.py /tmp/llama-1b-random --runs 3 [--dtype bfloat16]

Each round, with the checkpoint's pages dropped from the page cache first (posix_fadvise
DONTNEED on every file: no root needed, unlike /proc/sys/vm/drop_caches; `fincore` confirms):
  disk: the .safetensors files read sequentially into one reused 16 MiB buffer;
  load: a fresh process runs `load_model` (what `kubeinfer serve` does) and reports the loader's
        weights stage (read + copy into the parameters), the whole load, and the peak anonymous
        memory (RssAnon, sampled every 10 ms) up to the end of the weights stage and with the
        CPU GEMM prepack after it, beside the model's own bytes: whether a second full copy of
        the weights was ever held.
The two alternate, so a noisy neighbour hits both alike; each line is printed as measured.
On a shared machine the weights stage's wall time includes waiting for a CPU: each load also
reports the process's CPU seconds in that stage and the main thread's run-queue wait
(/proc/thread-self/schedstat), i.e. how long it was runnable but had no CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

_BUFFER = 16 << 20


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(files: list[Path]) -> int:
    """Bytes of `files` in the page cache, from util-linux's fincore."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split())


def read_disk(files: list[Path]) -> tuple[int, float]:
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    total, start = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - start


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_and_starved() -> tuple[float, float]:
    """(this process's CPU seconds, the calling thread's seconds runnable without a CPU)."""
    times = os.times()
    with open("/proc/thread-self/schedstat") as f:
        waited = int(f.read().split()[1]) / 1e9
    return times.user + times.system, waited


def child(model: str, dtype: str) -> None:
    """One load in this fresh process; prints its figures as JSON."""
    import logging

    import torch

    from kubeinfer.server.model.families.causal_lm import CausalLM
    from kubeinfer.server.model.loader import load_model

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("kubeinfer").addHandler(Keep())
    logging.getLogger("kubeinfer").setLevel(logging.INFO)
    baseline, peak, done = rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.01)

    before_prepack, at_prepack = [0], [(0.0, 0.0)]
    pack = CausalLM.pack_weights

    def pack_after_noting_peak(model: CausalLM) -> None:   # the weights stage ends where prepack starts
        before_prepack[0] = max(peak[0], rss_anon())
        at_prepack[0] = cpu_and_starved()
        pack(model)

    CausalLM.pack_weights = pack_after_noting_peak
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, at_start = time.perf_counter(), cpu_and_starved()
    loaded = load_model(model, dtype=dtype, device="cpu")
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    line = next(r for r in records if r.startswith("loaded "))
    weights = float(re.search(r"weights ([\d.]+)s", line).group(1))
    model_bytes = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    print(json.dumps({"load_seconds": seconds, "weights_seconds": weights, "loader_line": line,
                      "peak_anon_bytes": peak[0] - baseline,
                      "weights_peak_anon_bytes": before_prepack[0] - baseline, "model_bytes": model_bytes,
                      "torch_threads": torch.get_num_threads(),
                      "to_prepack_cpu_seconds": at_prepack[0][0] - at_start[0],
                      "to_prepack_starved_seconds": at_prepack[0][1] - at_start[1]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.model, args.dtype)
    files = sorted(Path(args.model).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"checkpoint {args.model}: {len(files)} files, {size / 1e9:.3f} GB; dtype {args.dtype}", flush=True)
    disk_rates, load_rates, ratios = [], [], []
    for run in range(1, args.runs + 1):
        drop_from_page_cache(files)
        before = cached_bytes(files)
        total, seconds = read_disk(files)
        disk = total / seconds / 1e9
        drop_from_page_cache(files)
        before_load = cached_bytes(files)
        out = subprocess.run([sys.executable, __file__, args.model, "--dtype", args.dtype, "--child"],
                             capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        load = size / result["weights_seconds"] / 1e9
        disk_rates.append(disk)
        load_rates.append(load)
        ratios.append(load / disk)
        print(f"run {run}: disk {disk:.3f} GB/s ({seconds:.2f} s; {before / 1e6:.0f} MB cached before) | "
              f"load weights {result['weights_seconds']:.2f} s = {load:.3f} GB/s = {load / disk:.0%} of disk "
              f"({before_load / 1e6:.0f} MB cached before), whole load_model {result['load_seconds']:.2f} s | "
              f"peak anon {result['weights_peak_anon_bytes'] / 1e9:.2f} GB to the end of the weights stage, "
              f"{result['peak_anon_bytes'] / 1e9:.2f} GB with prepack, for {result['model_bytes'] / 1e9:.2f} GB of "
              f"parameters", flush=True)
        print(f"        loader: {result['loader_line']}", flush=True)
        print(f"        load_model to the prepack: {result['to_prepack_cpu_seconds']:.2f} CPU s; main thread runnable "
              f"without a CPU {result['to_prepack_starved_seconds']:.2f} s", flush=True)
    print(f"median: disk {statistics.median(disk_rates):.3f} GB/s, load {statistics.median(load_rates):.3f} GB/s, "
          f"load/disk {statistics.median(ratios):.0%} (per run: {', '.join(f'{r:.0%}' for r in ratios)})")


if __name__ == "__main__":
    main()
