"""The W8A8 kernel's compile-time tile (`PANEL` output columns x `ROWS` rows of
kernels/cpu/int8_linear_cpu.c) on this CPU: each variant built apart, run on SmolLM2-135M's 120
linears (30 layers of qkv, o, gate|up, down) with the weights read from DRAM, alternated over
rounds (reversed every other round). Every variant must give the same outputs, bit for bit.
The defaults (PANEL 48, ROWS 4) were chosen this way on an AMD EPYC (Zen 4); run it on another
CPU (an Intel with AMX, say) before trusting them there.

    python benchmarks/int8_panels.py [--rows 32] [--variants 32x4,48x4,64x4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kubeinfer.kernels.cpu.cpu_build import CFLAGS, bind

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]   # (in, out) of each linear in a layer
LAYERS = 30


def build(panel: int, rows: int, folder: Path) -> tuple:
    """(pack, linear) of the kernel built with this tile."""
    library = folder / f"int8_{panel}x{rows}.so"
    subprocess.run(["gcc", *CFLAGS, f"-DPANEL={panel}", f"-DROWS={rows}", f"-I{KERNELS}",
                    str(KERNELS / "int8_linear_cpu.c"), "-o", str(library), "-lm"], check=True)
    loaded = ctypes.CDLL(str(library))
    if not bind(loaded, "int8_supported", pointers=0, ints=0)():
        raise SystemExit("this CPU lacks AVX512-VNNI / AVX512-BF16: the kernel does not run here")
    return bind(loaded, "int8_pack", pointers=3, ints=2), bind(loaded, "int8_linear_bf16", pointers=7, ints=5)


def packed_layers(pack, panel: int, weights: list) -> list:
    layers = []
    for layer in weights:
        packed = []
        for weight, scale in layer:
            n, k = weight.shape
            panels = -(-n // panel)
            panels_bytes = torch.empty(panels * panel * (-(-k // 4) * 4), dtype=torch.int8)
            colsum = torch.empty(panels * panel, dtype=torch.int32)
            pack(weight.data_ptr(), panels_bytes.data_ptr(), colsum.data_ptr(), n, k)
            scales = torch.zeros(panels * panel)
            scales[:n] = scale
            packed.append((panels_bytes, colsum, scales, n, k))
        layers.append(packed)
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows of x (32: a c=32 decode step)")
    parser.add_argument("--variants", default="32x4,48x4,64x4", help="PANELxROWS, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    variants = [tuple(int(part) for part in spec.split("x")) for spec in args.variants.split(",")]
    torch.manual_seed(0)
    weights = [[(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100) for k, n in SHAPES]
               for _ in range(LAYERS)]
    xs = {k: torch.randn(args.rows, k).to(torch.bfloat16) for k, _ in SHAPES}
    outs = {n: torch.empty(args.rows, n, dtype=torch.bfloat16) for _, n in SHAPES}
    evict = torch.empty(256 << 20, dtype=torch.uint8)   # larger than the caches: weights come from DRAM
    with tempfile.TemporaryDirectory() as folder:
        kernels = {}
        for panel, rows in variants:
            pack, linear = build(panel, rows, Path(folder))
            kernels[panel, rows] = (linear, packed_layers(pack, panel, weights))

        def run(variant: tuple[int, int]) -> torch.Tensor:
            linear, layers = kernels[variant]
            for layer in layers:
                for panels, colsum, scales, n, k in layer:
                    linear(xs[k].data_ptr(), panels.data_ptr(), colsum.data_ptr(), scales.data_ptr(), None,
                           outs[n].data_ptr(), None, args.rows, k, n, k, n)
            return torch.cat([out.clone() for out in outs.values()], dim=1)

        first = run(variants[0])
        for variant in variants[1:]:
            if not torch.equal(run(variant), first):
                raise SystemExit(f"variant {variant} gives other numbers than {variants[0]}")
        times: dict[tuple[int, int], list[float]] = {variant: [] for variant in variants}
        for round_ in range(args.rounds):
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                evict.add_(1)
                start = time.perf_counter()
                run(variant)
                times[variant].append((time.perf_counter() - start) * 1000)
    for (panel, rows), values in times.items():
        print(f"PANEL {panel:3d} ROWS {rows}: {args.rows} rows, {LAYERS * len(SHAPES)} linears from DRAM, ms "
              + " ".join(f"{value:.2f}" for value in sorted(values)))


if __name__ == "__main__":
    main()
