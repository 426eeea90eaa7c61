"""W8A8 int8 linear layers on the CPU: the kernel of `int8_linear_cpu.c` (built by `cpu_build`),
which quantizes each row of x to int8, multiplies with VNNI and rescales in one call, with the
numbers of the torch form in `server/model/quantization/weights.py` (see the C file).

`pack` lays an int8 weight [N, K] out in the kernel's panels once (at the first forward);
`linear` then takes bf16 or float32 rows of x. Without AVX512-VNNI, `available` is False. On a
CPU with AMX-INT8 the same panels also feed tiles (`linear(..., use_amx=True)`, K a multiple of
64): the same numbers, and the row count from which it is faster is measured per machine
(`amx_min_rows`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import cpu_build, quant_linear_cpu

_PANEL = 48   # output columns of a packed panel, PANEL in the C file
_FUNCTIONS = {torch.bfloat16: "int8_linear_bf16", torch.float32: "int8_linear_f32"}


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight [out_features, in_features] in the kernel's panels, its per-column sums
    and float32 scales (padded to whole panels)."""

    panels: torch.Tensor
    colsum: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int


@cpu_build.per_isa
def _functions() -> dict | None:
    library = cpu_build.load("int8_linear_cpu")
    if library is None or not cpu_build.bind(library, "int8_supported", pointers=0, ints=0)():
        return None
    functions = {dtype: cpu_build.bind(library, name, pointers=7, ints=5) for dtype, name in _FUNCTIONS.items()}
    if cpu_build.bind(library, "int8_amx_supported", pointers=0, ints=0)():
        for dtype, name in _FUNCTIONS.items():
            functions["amx", dtype] = cpu_build.bind(library, name.replace("int8_linear", "int8_linear_amx"),
                                                     pointers=7, ints=5)
        functions["amx_silu"] = cpu_build.bind(library, "int8_linear_amx_silu_bf16", pointers=5, ints=5)
    functions["pack"] = cpu_build.bind(library, "int8_pack", pointers=3, ints=2)
    for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        functions["quantize", dtype] = cpu_build.bind(library, f"int8_quantize_{suffix}", pointers=4, ints=3)
        functions["rescale", dtype] = cpu_build.bind(library, f"int8_rescale_{suffix}", pointers=4, ints=4)
    functions["rescale_silu"] = cpu_build.bind(library, "int8_rescale_silu_bf16", pointers=4, ints=4)
    return functions


def available() -> bool:
    """Whether the kernel runs here (built, and the CPU has AVX512-VNNI and AVX512-BF16)."""
    return _functions() is not None


def amx_available() -> bool:
    """Whether `linear` may take AMX tiles here: built with AMX-INT8, and Linux granted this
    process the tile state (asked for once, by quant_linear_cpu)."""
    functions = _functions()
    return functions is not None and ("amx", torch.float32) in functions and quant_linear_cpu.amx_available()


def amx_fits(in_features: int) -> bool:
    """Whether the AMX path takes a weight of this width (a tile row is 64 bytes of K)."""
    return in_features % 64 == 0


def building() -> bool:
    """Whether the kernel is still compiling in the background (`cpu_build.start_building`)."""
    return cpu_build.building("int8_linear_cpu")


def pack(weight: torch.Tensor, scale: torch.Tensor) -> PackedInt8:
    """int8 weight [N, K] and its float32 scale (per output channel [N], or one for all) -> panels."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"int8_linear_cpu.pack needs an int8 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    panels = -(-n // _PANEL)
    packed = torch.empty(panels * _PANEL * (-(-k // 4) * 4), dtype=torch.int8)
    colsum = torch.empty(panels * _PANEL, dtype=torch.int32)
    weight = weight.contiguous()
    _functions()["pack"](weight.data_ptr(), packed.data_ptr(), colsum.data_ptr(), n, k)
    scales = torch.zeros(panels * _PANEL, dtype=torch.float32)
    scales[:n] = scale.float().reshape(-1).expand(n)
    return PackedInt8(packed, colsum, scales, n, k)


def linear(x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None = None,
           input_scale: torch.Tensor | None = None, use_amx: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 or float32 rows, unit column stride) @ the weight, per-token dynamic int8
    activations (or the static `input_scale`), rescaled, + bias: [M, N] of x's dtype. `use_amx`:
    on AMX-INT8 tiles (`amx_available()` and `amx_fits(K)` must hold), the same numbers."""
    if not (x.device.type == "cpu" and x.dtype in _FUNCTIONS and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] == weight.in_features):
        raise ValueError(f"int8_linear_cpu.linear needs CPU rows [M, {weight.in_features}] of bf16 or float32")
    if use_amx and not (amx_available() and amx_fits(weight.in_features)):   # a tile op without the grant is SIGILL
        raise RuntimeError(f"int8_linear_cpu: no AMX path here for K={weight.in_features}")
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    static = input_scale.float().reshape(1).contiguous() if input_scale is not None else None
    function = _functions()[("amx", x.dtype) if use_amx else x.dtype]
    status = function(x.data_ptr(), weight.panels.data_ptr(), weight.colsum.data_ptr(),
                      weight.scale.data_ptr(), bias.data_ptr() if bias is not None else None,
                      out.data_ptr(), static.data_ptr() if static is not None else None,
                      x.shape[0], weight.in_features, weight.out_features, x.stride(0), out.stride(0))
    if status:
        raise MemoryError("int8_linear_cpu: no memory for the quantized activations")
    return out


def amx_silu_fits(weight: PackedInt8) -> bool:
    """Whether `linear_silu_and_mul` takes this gate|up weight: K a multiple of 64, and each half a
    whole number of panels (the up columns of a gate panel are then one panel further on)."""
    return amx_fits(weight.in_features) and weight.out_features % (2 * _PANEL) == 0


def linear_silu_and_mul(x: torch.Tensor, weight: PackedInt8, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul of `linear(x, weight, None, input_scale, use_amx=True)` for a gate|up weight
    [2I, K], bf16 rows of x -> bf16 [M, I], bit for bit, with the SiLU in the AMX epilogue (the
    [M, 2I] is never written). Needs `amx_available()` and `amx_silu_fits(weight)`."""
    if not (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] == weight.in_features):
        raise ValueError(f"int8_linear_cpu.linear_silu_and_mul needs CPU bf16 rows [M, {weight.in_features}]")
    if not (amx_available() and amx_silu_fits(weight)):
        raise RuntimeError(f"int8_linear_cpu: no AMX gate|up path here for a [{weight.out_features}, "
                           f"{weight.in_features}] weight")
    inter = weight.out_features // 2
    out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    static = input_scale.float().reshape(1).contiguous() if input_scale is not None else None
    if _functions()["amx_silu"](x.data_ptr(), weight.panels.data_ptr(), weight.scale.data_ptr(), out.data_ptr(),
                                static.data_ptr() if static is not None else None,
                                x.shape[0], weight.in_features, inter, x.stride(0), out.stride(0)):
        raise MemoryError("int8_linear_cpu: no memory for the quantized activations")
    return out


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16 or float32 rows, unit column stride) -> (int8 [M, K], float32 scales [M, 1]),
    the numbers of `quantize_int8_per_token` (or of `quantize_int8_static` with `input_scale`) in
    one pass: for `torch._int_mm` at the sizes where it beats `linear`."""
    if not (x.device.type == "cpu" and x.dtype in _FUNCTIONS and x.dim() == 2 and x.stride(1) == 1):
        raise ValueError("int8_linear_cpu.quantize_rows needs CPU rows [M, K] of bf16 or float32")
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32)
    static = input_scale.float().reshape(1).contiguous() if input_scale is not None else None
    if _functions()["quantize", x.dtype](x.data_ptr(), q.data_ptr(), scales.data_ptr(),
                                          static.data_ptr() if static is not None else None,
                                          x.shape[0], x.shape[1], x.stride(0)):
        raise MemoryError("int8_linear_cpu: no memory to quantize the activations")
    return q, scales


def rescale(products: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 products [M, N] -> `products.float().mul_(x_scale).mul_(w_scale).to(dtype)`, bit for
    bit, in one pass; `x_scale` [M, 1] or one value, `w_scale` [N] or one value."""
    products = products.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    m, n = products.shape
    out = torch.empty(m, n, dtype=dtype)
    _functions()["rescale", dtype](products.data_ptr(), x_scale.data_ptr(), w_scale.data_ptr(), out.data_ptr(), m, n,
                                   int(x_scale.numel() != 1), int(w_scale.numel() != 1))
    return out


def rescale_silu_and_mul(products: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """int32 products of a gate|up GEMM [M, 2I] -> `silu_and_mul(rescale(products, x_scale, w_scale,
    torch.bfloat16))` [M, I] in bf16, bit for bit, in one pass (no bf16 [M, 2I] in between)."""
    products = products.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    m, n = products.shape
    if n % 2 or w_scale.numel() not in (1, n):
        raise ValueError(f"rescale_silu_and_mul needs [M, 2I] products and 1 or 2I weight scales, got {n} and "
                         f"{w_scale.numel()}")
    out = torch.empty(m, n // 2, dtype=torch.bfloat16)
    _functions()["rescale_silu"](products.data_ptr(), x_scale.data_ptr(), w_scale.data_ptr(), out.data_ptr(), m,
                                 n // 2, int(x_scale.numel() != 1), int(w_scale.numel() != 1))
    return out


# Row counts at which the AMX path is timed against the VNNI one, on a weight of the size of a
# small model's MLP (timings: BENCHMARKS.md, "AMX-INT8 for the W8A8 linears").
_PLAN_ROWS = (1, 2, 4, 8, 16, 32, 64)
_PLAN_SHAPE = (1536, 576)   # out, in: SmolLM2's gate (in % 64 == 0)


@cpu_build.per_isa
def amx_min_rows() -> int | None:
    """Fewest rows of x from which the AMX path beats the VNNI one on this machine, measured once
    per process (a few ms): the smallest sampled row count from which AMX is faster at every larger
    sample. None: no AMX here, or it never won."""
    if not (available() and amx_available()):
        return None
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = _PLAN_SHAPE
    weight = pack(torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator),
                  torch.full((out_features,), 1e-3))
    amx_wins = []
    for rows in _PLAN_ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        times = {use_amx: _best_seconds(lambda: linear(x, weight, use_amx=use_amx)) for use_amx in (False, True)}
        amx_wins.append(times[True] < times[False])
    for i, rows in enumerate(_PLAN_ROWS):
        if all(amx_wins[i:]):
            return rows
    return None


def _best_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def amx_takes(rows: int, in_features: int) -> bool:
    """Whether `rows` rows of x against a weight of this width go to the AMX path here."""
    if not amx_fits(in_features):
        return False
    threshold = amx_min_rows()
    return threshold is not None and rows >= threshold
