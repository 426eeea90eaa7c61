"""On a CUDA GPU: sweep the paged-attention knobs that have no CPU stand-in, and profile the
engine's decode step.

- `PREFILL_ROWS` (query rows per prefill tile) on causal prefill and chunked prefill, with the
  largest error against the torch reference at each setting;
- split-KV decode at several split counts for batch 1-16 at long contexts;
- `--profile MODEL`: 32 sequences decoding on the engine; where one step's wall time goes
  (cProfile by Python function, torch.profiler by op).

    python benchmarks/gpu_tune.py [--profile /path/to/model]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from triton.testing import do_bench

from kubeinfer.kernels.tools import bench
from kubeinfer.kernels.tools.bench_cases import attention_case
from kubeinfer.kernels.triton import attention_launch


def sweep_prefill_rows(args: argparse.Namespace) -> None:
    for rows in (16, 32, 64, 128):
        attention_launch.PREFILL_ROWS = rows
        for name, batch, q_len, context in (("prefill", 4, 2048, 0), ("chunked", 4, 512, 4096),
                                            ("short chunks", 32, 64, 1024)):
            case = attention_case(args, name, batch, q_len, context, num_splits=1)
            error = (case.runs["triton"]().float() - case.runs["torch"]().float()).abs().max().item()
            ms = do_bench(case.runs["triton"], return_mode="median")
            print(f"PREFILL_ROWS={rows:<4}{name:<14}{ms:9.4f} ms {case.flops / ms / 1e9:7.1f} TFLOP/s  "
                  f"max|err| {error:.4f}  {case.shape}", flush=True)
    attention_launch.PREFILL_ROWS = 16


def sweep_splits(args: argparse.Namespace) -> None:
    for batch, context in ((1, 65536), (1, 8192), (4, 16384), (16, 4096), (64, 4096)):
        for splits in (1, 4, 8, 16, 32, 64, 128):
            if context // splits < 256:
                continue
            case = attention_case(args, "decode", batch, 1, context, num_splits=splits)
            ms = do_bench(case.runs["triton"], return_mode="median")
            print(f"splits={splits:<4}{ms:9.4f} ms {case.bytes_moved / ms / 1e6:7.0f} GB/s  {case.shape}", flush=True)


def profile_engine(model: str, batch: int) -> None:
    from kubeinfer.server.engine.config import EngineConfig
    from kubeinfer.server.engine.llm_engine import LLMEngine
    from kubeinfer.server.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=batch))
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [(i * 7 + j) % 500 + 10 for j in range(128)], params)
    for _ in range(20):   # prefill, then warm decode
        engine.step()

    def steps(count: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / count

    print(f"decode step, batch {batch}: {steps(50) * 1e3:.2f} ms", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    steps(30)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[-9000:], flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps(10)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--profile", metavar="MODEL", help="Also profile the engine's decode step on this model.")
    parser.add_argument("--profile-batch", type=int, default=32)
    parser.add_argument("--skip-sweeps", action="store_true")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()} | {args.dtype} | torch {torch.__version__}", flush=True)
    if not args.skip_sweeps:
        sweep_prefill_rows(args)
        sweep_splits(args)
    if args.profile:
        profile_engine(args.profile, args.profile_batch)


if __name__ == "__main__":
    main()
