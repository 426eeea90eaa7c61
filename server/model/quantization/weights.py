"""Compute forms of checkpoint-quantized linear weights.

Every format the loader reads (compressed-tensors, GPTQ, AWQ, on-the-fly fp8/int8) is converted
once, at load, into one of three forms that stay quantized in memory; each forward computes from
that form, so a 4-bit model holds about a quarter of its bf16 bytes. GGUF's blocks are a fourth
form, kept beside the layer's dense weight (`GGUFBlockWeight`, see `gguf.py`):

- `PackedIntWeight`: 4- or 8-bit integers packed along the input dimension in GPTQ's int32
  layout, with a scale and a zero point per group of input features (W4A16, W8A16, GPTQ, AWQ).
  CUDA runs the Triton dequant-in-GEMM kernel (`kernels/triton/w4a16.py`); elsewhere the layer's
  weight is dequantized (`kernels/reference/w4a16_ref.py`) for the matmul and dropped again.
- `Int8Weight`: int8 weights with per-output-channel scales; with activation quantization
  (W8A8) x is quantized per token (dynamic) or with the checkpoint's scale (static) and the GEMM
  runs on int8 (`torch._int_mm`: oneDNN's AMX-INT8 / VNNI on CPU), scaled back in float32.
- `Fp8Weight`: float8 e4m3 weights with per-tensor or per-channel scales; activations are
  quantized to e4m3 per token (dynamic) or with the checkpoint's scale (static), as on an FP8
  GPU, and the product is computed in float32 from the dequantized operands.

Dynamic per-token scales are amax/127 (int8) and amax/448 (e4m3), vLLM's convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from kubeinfer.kernels import ops, ops_cpu
from kubeinfer.kernels.ops import dequantize_kn, pack_rows, unpack_rows

from ..layers.linear import linear

__all__ = ["Fp8Weight", "GGUFBlockWeight", "Int8Weight", "PackedIntWeight", "pack_rows", "quantize_per_channel",
           "unpack_rows"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_INT8_EPS = 1e-10


@dataclass
class PackedIntWeight:
    """w[n, k] = (q[k', n] - zeros[k' // group_size, n]) * scales[k' // group_size, n], where
    k' is k's position after `perm` (GPTQ act-order: input features sorted by group)."""

    qweight: torch.Tensor          # int32 [ceil(K / (32 / bits)), N]
    scales: torch.Tensor           # float32 [ceil(K / group_size), N]
    zeros: torch.Tensor            # float32 [ceil(K / group_size), N] (2^(bits-1) when symmetric)
    bits: int
    group_size: int
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None   # int64 [K]: the layer reads x[:, perm]

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"{self.bits}-bit packed weights are not supported (4 and 8 are)")

    def dequantize_kn(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight transposed, [K, N] in `dtype` (rows in `perm` order): computed in float32."""
        return dequantize_kn(self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.in_features,
                             dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in checkpoint input order, as `F.linear` takes it."""
        weight = self.dequantize_kn(dtype)
        if self.perm is not None:
            weight = torch.empty_like(weight).index_copy_(0, self.perm, weight)
        return weight.t()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        rows = x.reshape(-1, self.in_features)
        if ops.uses_triton(rows):   # dequant-in-GEMM: the weight is never written out dequantized
            out = ops.triton_w4a16_matmul(rows, self.qweight, self.scales, self.zeros, self.group_size, self.bits)
        else:
            out = rows @ self.dequantize_kn(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.out_features)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """No one-pass form here: None, the caller runs `forward` then SiLU-and-mul."""
        return None


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]) with scale amax/127 per row."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=_INT8_EPS) / 127.0
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale


def quantize_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)


def _int_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [K, N] -> int32 exactly. CUDA's `_int_mm` needs more than 16 rows and
    K, N multiples of 8: fewer rows are padded; other shapes go through int32 on the host."""
    if a.is_cuda:
        if a.shape[1] % 8 or b_t.shape[1] % 8:
            return (a.cpu().int() @ b_t.cpu().int()).to(a.device)
        if a.shape[0] <= 16:
            return torch._int_mm(F.pad(a, (0, 0, 0, 17 - a.shape[0])), b_t)[:a.shape[0]]
    return torch._int_mm(a.contiguous(), b_t)


@dataclass
class ScaledWeight:
    """8-bit weights [N, K] with float32 scales per output channel (a per-tensor scale is
    broadcast); `activations` None (weight-only), "dynamic" (per-token scales) or "static" (the
    checkpoint's `input_scale`, a float32 scalar). The subclasses differ only in how they compute."""

    weight: torch.Tensor                   # int8 or float8_e4m3fn [N, K]
    scale: torch.Tensor                    # float32 [N]
    activations: str | None = None
    input_scale: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """`silu_and_mul(self.forward(x, None))` for a gate|up weight in one pass where a kernel has
        that form; None: the caller runs the two steps."""
        return None


# Without AMX-INT8, or below the row count from which it measured faster (`amx_min_rows`; on AMX it
# also beat torch._int_mm, which runs oneDNN's VNNI GEMM there, at every size: BENCHMARKS.md,
# "Intel AMX: AMX-INT8 for the W8A8 linears"). Where the fused CPU kernel beats quantize +
# torch._int_mm + rescale (measured on an AMD EPYC with AVX512-VNNI, BENCHMARKS.md issue 23): few
# rows (decode, where even one-pass quantize and rescale cost more than they save: 1.2-1.7x at 32
# rows) and outputs of 8M+ elements (the int32 [M, N] products then cost page faults). Between
# them oneDNN's GEMM is faster than the kernel's (BENCHMARKS.md, "W8A8 prefill without torch's
# passes"); at 4,096 tokens the two were level.
INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MIN_OUTPUTS = 64, 1 << 23


def _int8_kernel_is_faster(rows: int, out_features: int) -> bool:
    return rows <= INT8_KERNEL_MAX_ROWS or rows * out_features >= INT8_KERNEL_MIN_OUTPUTS


@dataclass
class Int8Weight(ScaledWeight):
    """int8 weights; dynamic or static activations run as an int8 x int8 matmul: on the CPU the
    fused kernel of `kernels/cpu/int8_linear_cpu.c` (quantize, AMX-INT8 tiles from the row count
    measured on this machine, else VNNI, rescale in one call) where it is faster, else
    `torch._int_mm` between that file's one-pass quantize and rescale; elsewhere
    `torch._int_mm` between torch passes (`forward_torch`, the numbers all of them give)."""

    _packed: ops_cpu.PackedInt8 | None = field(default=None, init=False, repr=False, compare=False)

    def _cpu_kernels_take(self, rows: torch.Tensor) -> bool:
        """Whether the int8 CPU kernels compute these rows [M, K]: int8 activations, CPU rows of
        bf16 or float32 with unit column stride, the kernels built."""
        return (self.activations is not None and rows.device.type == "cpu"
                and rows.dtype in (torch.bfloat16, torch.float32) and rows.stride(1) == 1
                and ops_cpu.int8_kernel_ready())

    @property
    def _static_scale(self) -> torch.Tensor | None:
        return self.input_scale if self.activations == "static" else None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._cpu_kernels_take(rows):
            static = self._static_scale
            if ops_cpu.int8_amx_takes(rows.shape[0], self.in_features):
                out = ops_cpu.int8_linear(rows, self.packed(), bias, static, use_amx=True)
            elif _int8_kernel_is_faster(rows.shape[0], self.out_features):
                out = ops_cpu.int8_linear(rows, self.packed(), bias, static)
            else:   # oneDNN's GEMM between the kernel's one-pass quantize and rescale
                xq, x_scale = ops_cpu.int8_quantize_rows(rows, static)
                out = ops_cpu.int8_rescale(_int_mm(xq, self.weight.t()), x_scale, self.scale, rows.dtype)
                if bias is not None:
                    out = out + bias
            return out.view(*x.shape[:-1], self.out_features)
        return self.forward_torch(x, bias)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The rescale and SiLU in one pass on the CPU where the forward goes through AMX tiles (in
        the GEMM's epilogue) or `torch._int_mm` (prefill sizes), bf16 activations."""
        rows = x.reshape(-1, self.in_features)
        if not (self._cpu_kernels_take(rows) and rows.dtype == torch.bfloat16):
            return None
        if ops_cpu.int8_amx_takes(rows.shape[0], self.in_features):
            if not ops_cpu.int8_amx_silu_fits(self.packed()):
                return None
            out = ops_cpu.int8_linear_silu_and_mul(rows, self.packed(), self._static_scale)
            return out.view(*x.shape[:-1], self.out_features // 2)
        if _int8_kernel_is_faster(rows.shape[0], self.out_features):
            return None
        xq, x_scale = ops_cpu.int8_quantize_rows(rows, self._static_scale)
        out = ops_cpu.int8_rescale_silu_and_mul(_int_mm(xq, self.weight.t()), x_scale, self.scale)
        return out.view(*x.shape[:-1], self.out_features // 2)

    def packed(self) -> ops_cpu.PackedInt8:
        """The weight in the CPU kernel's panels, made at the first forward (tensor parallelism's
        slices are new objects, `dataclasses.replace`, so each packs its own)."""
        if self._packed is None:
            self._packed = ops_cpu.int8_pack(self.weight, self.scale)
        return self._packed

    def forward_torch(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.activations is None:
            out = F.linear(rows, self.dequantize(x.dtype))
        else:
            if self.activations == "dynamic":
                xq, x_scale = quantize_int8_per_token(rows)
            else:
                xq, x_scale = quantize_int8_static(rows, self.input_scale), self.input_scale
            # Rescaled in place: `x_scale * self.scale` first would write an [M, N] float32
            # matrix of scales, most of the layer's time (BENCHMARKS.md, issue 23).
            out = _int_mm(xq, self.weight.t()).float().mul_(x_scale).mul_(self.scale).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.out_features)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x rounded through e4m3 with `scale` (None: amax/448 per row), back in float32."""
    x = x.float()
    if scale is None:
        scale = x.abs().amax(-1, keepdim=True).clamp(min=_INT8_EPS) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


@dataclass
class Fp8Weight(ScaledWeight):
    """float8 e4m3 weights; `activations` may also be "dynamic-tensor" (one amax/448 scale for the
    whole input: the `fp8` checkpoints' dynamic scheme, as vLLM)."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.activations is None:
            out = F.linear(rows, self.dequantize(x.dtype))
        else:
            scale = {"static": self.input_scale, "dynamic": None}.get(self.activations)
            if self.activations == "dynamic-tensor":
                scale = rows.float().abs().amax().clamp(min=_INT8_EPS) / FP8_MAX
            xq = fake_quantize_fp8(rows, scale)
            out = F.linear(xq, self.dequantize()).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.out_features)


@dataclass
class GGUFBlockWeight:
    """A GGUF matrix (Q4_0, Q4_1, Q8_0) in the CPU kernel's tiles beside the layer's dense bf16
    weight and its oneDNN copy: batches of up to the kernel's row limit (decode) read the tiles,
    3.5x fewer bytes than bf16 for Q4_1 with the same values; larger ones run the dense GEMM."""

    tiles: ops_cpu.GGUFTiles
    weight: torch.Tensor                   # bf16 [N, K]: the same values, dequantized
    packed: torch.Tensor | None            # its `pack_weight` copy, when the layer has one

    @property
    def in_features(self) -> int:
        return self.tiles.in_features

    @property
    def out_features(self) -> int:
        return self.tiles.out_features

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] (bf16 for the tiles) @ the weight + bias."""
        if ops_cpu.gguf_kernel_is_faster(x.shape[0]):
            return ops_cpu.gguf_linear(x, self.tiles, bias)
        return linear(x, self.weight, self.packed, bias)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """No one-pass form here: None, the caller runs `forward` then SiLU-and-mul."""
        return None


QuantizedLinearWeight = PackedIntWeight | Int8Weight | Fp8Weight | GGUFBlockWeight


def quantize_per_channel(weight: torch.Tensor, kind: str) -> QuantizedLinearWeight:
    """A dense weight [N, K] quantized at load with one scale per output channel, activations
    dynamic per token (`--quantization fp8` / `int8` on an unquantized checkpoint, as vLLM)."""
    weight = weight.float()
    amax = weight.abs().amax(-1).clamp(min=_INT8_EPS)
    if kind == "fp8":
        scale = amax / FP8_MAX
        return Fp8Weight((weight / scale[:, None]).to(torch.float8_e4m3fn), scale, "dynamic")
    scale = amax / 127.0
    return Int8Weight(torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale, "dynamic")
