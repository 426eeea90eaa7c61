"""The W8A8 int8 linear's paths on this CPU, per row count, timed in alternation (median of rounds,
microseconds a call): the fused kernel on VNNI and on AMX-INT8 tiles (`kernels/cpu/int8_linear_cpu.c`,
quantize and rescale included), the kernel's quantize + `torch._int_mm` + rescale (what mid-size
rows took before AMX), and bf16 `F.linear` of the same weight (oneDNN). SmolLM2-135M's four linears.
Also prints the row count from which this process measured AMX faster (`amx_min_rows`).

    python benchmarks/int8_paths.py [--threads N] [--rounds R]
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from int8_gemm import threads_and_rounds, timed  # this folder: a script's own folder is on its path
from kubeinfer.kernels.cpu import int8_linear_cpu

# (name, K, N): qkv, o, gate|up, down of SmolLM2-135M
LINEARS = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
ROWS = [1, 4, 16, 32, 64, 256, 2048, 4096]


def main() -> None:
    args = threads_and_rounds(__doc__.splitlines()[0])
    if not int8_linear_cpu.available():
        raise SystemExit("the int8 kernel does not run here (needs AVX512-VNNI and AVX512-BF16)")
    amx = int8_linear_cpu.amx_available()
    print(f"threads {args.threads}; AMX-INT8 {'available' if amx else 'not available'}; "
          f"amx_min_rows {int8_linear_cpu.amx_min_rows()}; us per call, median of {args.rounds} alternated rounds")
    print(f"{'linear':>8} {'rows':>5} {'vnni':>9} {'amx':>9} {'_int_mm':>9} {'bf16':>9} {'vnni/amx':>8} "
          f"{'int_mm/amx':>10}")
    for name, k, n in LINEARS:
        generator = torch.Generator().manual_seed(k * n)
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        scale = torch.rand(n, generator=generator) / 100
        packed, dense = int8_linear_cpu.pack(weight, scale), (weight.float() * scale[:, None]).to(torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)

            def int_mm_route() -> torch.Tensor:
                xq, x_scale = int8_linear_cpu.quantize_rows(x)
                return int8_linear_cpu.rescale(torch._int_mm(xq, weight.t()), x_scale, scale, torch.bfloat16)

            paths = {"vnni": lambda: int8_linear_cpu.linear(x, packed), "_int_mm": int_mm_route,
                     "bf16": lambda: F.linear(x, dense)}
            if amx:
                paths["amx"] = lambda: int8_linear_cpu.linear(x, packed, use_amx=True)
            repeats = max(1, int(2e8 / (2 * rows * k * n)))
            times = {path: [] for path in paths}
            for _ in range(args.rounds):
                for path, run in paths.items():
                    times[path].append(timed(run, repeats) * 1e6)
            us = {path: statistics.median(values) for path, values in times.items()}
            amx_us = us.get("amx", float("nan"))
            print(f"{name:>8} {rows:>5} {us['vnni']:>9.1f} {amx_us:>9.1f} {us['_int_mm']:>9.1f} {us['bf16']:>9.1f} "
                  f"{us['vnni'] / amx_us:>8.2f} {us['_int_mm'] / amx_us:>10.2f}")


if __name__ == "__main__":
    main()
