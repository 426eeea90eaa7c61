"""`kubeinfer bench-kernels`: time the Triton kernels against their torch references on a GPU.

Timings come from `triton.testing.do_bench` (median ms). Each row shows achieved GB/s and
TFLOP/s, and the H100 SXM roofline time: max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s).
Without CUDA it exits with status 2 and says why: a CPU number would mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

H100_BYTES_PER_S = 3.35e12     # HBM3, H100 SXM
H100_FLOPS = 989e12            # dense bf16/fp16 tensor-core peak, H100 SXM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--intermediate-size", type=int, default=14336)
    parser.add_argument("--tokens", type=int, default=4096, help="Tokens per step for the elementwise kernels.")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096, help="Cached tokens per decode sequence.")
    parser.add_argument("--long-context", type=int, default=65536, help="Context of the batch-1 split-KV case.")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--skip-torch", action="store_true", help="Skip the (slow) torch references.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object per row instead of a table.")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("kubeinfer bench-kernels: no CUDA device visible (torch.cuda.is_available() is False); "
              "the kernels can only be timed on an NVIDIA GPU. Tests run them on the CPU under "
              "TRITON_INTERPRET=1: pytest tests/kernels", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from .bench_cases import attention_case, elementwise_cases

    cases = [
        attention_case(args, "decode attention", args.decode_batch, 1, args.context, num_splits=1),
        attention_case(args, "decode split-KV", 1, 1, args.long_context, num_splits=None),
        attention_case(args, "decode unified", 1, 1, args.long_context, num_splits=1),
        attention_case(args, "prefill attention", 4, args.prefill_len, 0, num_splits=1),
        attention_case(args, "chunked prefill", 4, 512, args.context, num_splits=1),
        *elementwise_cases(args),
    ]
    print(f"# {torch.cuda.get_device_name()} | {args.dtype} | torch {torch.__version__}", file=sys.stderr)
    header = f"{'kernel':<20}{'impl':<8}{'ms':>9}{'GB/s':>9}{'TFLOP/s':>9}{'H100 ms':>9}  shape"
    if not args.json:
        print(header)
    for case in cases:
        roofline_ms = max(case.bytes_moved / H100_BYTES_PER_S, case.flops / H100_FLOPS) * 1e3
        for impl, launch in case.runs.items():
            if impl == "torch" and args.skip_torch:
                continue
            ms = do_bench(launch, return_mode="median")
            row = dict(kernel=case.name, impl=impl, ms=ms, gbps=case.bytes_moved / ms / 1e6,
                       tflops=case.flops / ms / 1e9, h100_roofline_ms=roofline_ms, shape=case.shape)
            print(json.dumps(row) if args.json else
                  f"{case.name:<20}{impl:<8}{ms:>9.4f}{row['gbps']:>9.0f}{row['tflops']:>9.1f}"
                  f"{roofline_ms:>9.4f}  {case.shape}")
    return 0
