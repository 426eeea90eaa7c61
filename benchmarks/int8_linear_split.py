"""Where a W8A8-int8 linear's time goes on this CPU: the engine's `Int8Weight.forward` (dynamic
per-token activations) split into its parts, against the bf16 `F.linear` of the same weight,
timed in alternation (median of rounds); the last row is the same rescale without the [M, N]
float32 matrix of combined scales. Shapes: SmolLM2-135M's MLP up-projection at decode
(M=32) and prefill (M=512) sizes.

    python benchmarks/int8_linear_split.py [--threads N] [--rounds R]
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from int8_gemm import threads_and_rounds, timed  # this folder: a script's own folder is on its path
from kubeinfer.server.model.quantization.weights import Int8Weight, quantize_int8_per_token, quantize_per_channel


def main() -> None:
    args = threads_and_rounds(__doc__.splitlines()[0])
    print(f"threads {args.threads}; microseconds per call, median of {args.rounds} alternated rounds")
    for m, k, n in [(32, 576, 1536), (512, 576, 1536)]:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.05
        int8 = quantize_per_channel(weight, "int8")
        assert isinstance(int8, Int8Weight) and int8.activations == "dynamic"
        x = torch.randn(m, k, dtype=torch.bfloat16)
        xq, x_scale = quantize_int8_per_token(x)
        w_t, w_kn = int8.weight.t(), int8.weight.t().contiguous()
        acc = torch._int_mm(xq, w_kn)
        parts = {
            "bf16 F.linear": lambda: F.linear(x, weight),
            "Int8Weight.forward": lambda: int8.forward(x, None),
            "  quantize_int8_per_token": lambda: quantize_int8_per_token(x),
            "  _int_mm(xq, weight.t())": lambda: torch._int_mm(xq, w_t),
            "  _int_mm(xq, [K,N] contiguous)": lambda: torch._int_mm(xq, w_kn),
            "  rescale int32 -> bf16": lambda: (acc.float() * (x_scale * int8.scale)).to(torch.bfloat16),
            "  rescale, in place (no [M,N] scales)": lambda: acc.float().mul_(x_scale).mul_(int8.scale).to(torch.bfloat16),
        }
        results = {name: [] for name in parts}
        for _ in range(args.rounds):
            for name, fn in parts.items():
                results[name].append(timed(fn, 200) * 1e6)
        print(f"M={m} K={k} N={n}")
        for name, values in results.items():
            print(f"  {name:34s} {statistics.median(values):9.1f}")


if __name__ == "__main__":
    main()
