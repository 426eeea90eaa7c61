"""Linear layers on GGUF-quantized weights (Q4_0, Q4_1, Q8_0) for bf16 activations on CPU: the
kernel of `quant_linear_cpu.c` (built by `cpu_build`).

CPU decode reads every weight once a step, so it runs at memory speed: Q4_1 weights are 3.5x
fewer bytes than their bf16 dequantization, with the same values (see the C file). `pack`
rearranges GGUF blocks into the kernel's 16 x 32 tiles once, at load time (in C: in torch it
was a visible part of the embedded model's start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_build

_KIND_Q4, _KIND_Q8 = 0, 1
_TILE_BYTES = {_KIND_Q4: 320, _KIND_Q8: 544}   # 16 x 32 weights: quants, fp16 scales (and offsets)
_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")         # quant_pack's numbering
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}   # GGUF bytes per 32 weights (ggml-common.h)
# Most rows of x for which the kernel beats oneDNN's bf16 GEMM on prepacked weights (measured:
# kernels/README.md). Without AMX the kernel takes only its register path (up to 4 rows).
MAX_ROWS_AMX, MAX_ROWS_AVX512 = 64, 4


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out_features, in_features] in the kernel's tiles: uint8 [out/16, in/32, tile bytes]."""

    tiles: torch.Tensor
    kind: int
    out_features: int
    in_features: int


@cpu_build.per_isa
def _functions() -> tuple | None:
    library = cpu_build.load("quant_linear_cpu")
    if library is None:
        return None
    if not cpu_build.bind(library, "quant_supported", pointers=0, ints=0)():   # no AVX512-BF16
        return None
    return (cpu_build.bind(library, "quant_linear_bf16", pointers=4, ints=5),
            cpu_build.bind(library, "quant_unpack_bf16", pointers=2, ints=3),
            cpu_build.bind(library, "amx_request", pointers=0, ints=0),
            cpu_build.bind(library, "quant_pack", pointers=2, ints=3),
            cpu_build.bind(library, "quant_dequantize_bf16", pointers=2, ints=3))


@cpu_build.per_isa
def amx_available() -> bool:
    """Whether the kernel may use AMX tiles (built with AMX, and Linux granted this process the state)."""
    functions = _functions()
    return functions is not None and functions[2]() == 0


def available() -> bool:
    """Whether quantized linears run here (kernel built, CPU with AVX512-BF16)."""
    return _functions() is not None


def faster_than_dense(rows: int) -> bool:
    """Whether x with this many rows should use the quantized weights (kernel built, see MAX_ROWS_*)."""
    return available() and rows <= (MAX_ROWS_AMX if amx_available() else MAX_ROWS_AVX512)


def can_pack(qtype: str, out_features: int, in_features: int) -> bool:
    return qtype in BLOCK_BYTES and out_features % 16 == 0 and in_features % 32 == 0


def pack(qtype: str, blocks: torch.Tensor) -> QuantizedWeight:
    """GGUF blocks uint8 [out, in/32, block bytes] of `qtype` -> the kernel's tiles."""
    out_features, k_blocks, block_bytes = blocks.shape
    if not can_pack(qtype, out_features, 32 * k_blocks) or block_bytes != BLOCK_BYTES[qtype]:
        raise ValueError(f"cannot pack {qtype} blocks of shape {tuple(blocks.shape)}")
    kind = _KIND_Q8 if qtype == "Q8_0" else _KIND_Q4
    blocks = blocks.contiguous()
    tiles = torch.empty(out_features // 16, k_blocks, _TILE_BYTES[kind], dtype=torch.uint8)
    _functions()[3](blocks.data_ptr(), tiles.data_ptr(), out_features, 32 * k_blocks, _GGUF_TYPES.index(qtype))
    return QuantizedWeight(tiles, kind, out_features, 32 * k_blocks)


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
           use_amx: bool | None = None) -> torch.Tensor:
    """`x [rows, in] @ W.T + bias` in bf16 with float32 sums; `use_amx` None = when available."""
    linear_bf16 = _functions()[0]
    if use_amx is None:
        use_amx = amx_available()
    elif use_amx and not amx_available():   # a tile instruction without the OS's grant is SIGILL
        raise RuntimeError("AMX is not available to this process")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"quantized linear needs bf16 x [rows, {weight.in_features}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weight.out_features)
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    status = linear_bf16(x.data_ptr(), weight.tiles.data_ptr(), None if bias is None else bias.data_ptr(),
                         out.data_ptr(), x.shape[0], weight.out_features, weight.in_features, weight.kind,
                         int(use_amx))
    if status:
        raise RuntimeError(f"quantized linear kernel failed (status {status}) for x {tuple(x.shape)}, "
                           f"weight [{weight.out_features}, {weight.in_features}]")
    return out


def dequantize(qtype: str, blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks of `qtype` (uint8, row-major, `rows * cols / 32` of them) -> bf16 [rows, cols],
    exactly the values of a float32 dequantization rounded to bf16."""
    if (qtype not in BLOCK_BYTES or cols % 32 or blocks.dtype != torch.uint8
            or blocks.numel() != rows * cols // 32 * BLOCK_BYTES[qtype]):
        raise ValueError(f"cannot dequantize {blocks.numel()} {blocks.dtype} as {qtype} [{rows}, {cols}]")
    blocks = blocks.contiguous()
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    status = _functions()[4](blocks.data_ptr(), out.data_ptr(), rows, cols, _GGUF_TYPES.index(qtype))
    if status:
        raise RuntimeError(f"GGUF dequantize kernel failed (status {status}) for {qtype} [{rows}, {cols}]")
    return out


def unpack(weight: QuantizedWeight) -> torch.Tensor:
    """The bf16 weight [out, in] the tiles stand for."""
    out = torch.empty(weight.out_features, weight.in_features, dtype=torch.bfloat16)
    _functions()[1](weight.tiles.data_ptr(), out.data_ptr(), weight.out_features, weight.in_features, weight.kind)
    return out
