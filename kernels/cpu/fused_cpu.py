"""Fused CPU kernels of `fused_cpu.c` (via `cpu_build`): RMSNorm(+residual), SiLU-and-mul,
rotary in place, the KV-cache store (quantizing into an fp8 cache), a structured-output
token bitmask applied to logits, and inverse-transform sampling of logits.

One call replaces the ~10 torch ops of HF's RMSNorm (float copy, pow, mean, rsqrt, casts,
products, the residual add), the 3 of SiLU-and-mul and the 5 of the rotary embedding, with the
same roundings (see the C file). The store copies rows where `index_copy_` moved elements.
"""

from __future__ import annotations


import torch

from . import cpu_build
from ..reference.kv_cache_ref import FP8_MAX, inverse_scale

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@cpu_build.per_isa
def _functions(dtype: torch.dtype) -> tuple | None:
    library = cpu_build.load("fused_cpu")
    if library is None or dtype not in _SUFFIX:
        return None
    suffix = _SUFFIX[dtype]
    return (cpu_build.bind(library, f"rms_norm_{suffix}", pointers=5, ints=2, floats=1),
            cpu_build.bind(library, f"silu_and_mul_{suffix}", pointers=2, ints=2),
            cpu_build.bind(library, f"rotary_{suffix}", pointers=3, ints=4),
            cpu_build.bind(library, "store_kv", pointers=5, ints=3),
            cpu_build.bind(library, f"store_kv_fp8_{suffix}", pointers=5, ints=4, floats=2))


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels take `x` (a CPU tensor of a supported dtype, kernels built)."""
    return x.device.type == "cpu" and _functions(x.dtype) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As `rms_norm_ref`: with `residual`, returns (normed, x + residual) in new tensors."""
    norm = _functions(x.dtype)[0]
    x = x.contiguous()
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = torch.empty_like(x)
    weight = weight.to(x.dtype).contiguous()
    if residual is None:
        norm(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
        return out
    residual = residual.to(x.dtype).contiguous()
    summed = torch.empty_like(x)
    norm(x.data_ptr(), residual.data_ptr(), summed.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` as `silu_and_mul_ref`."""
    fused = _functions(x.dtype)[1]
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    fused(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter)
    return out


def rows_of_heads(x: torch.Tensor) -> bool:
    """[T, heads, D] with each row's heads contiguous (any row stride), as views of qkv are."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def same_rows(k: torch.Tensor, v: torch.Tensor) -> bool:
    """k and v both [T, heads, D] rows of heads (`rows_of_heads`) with one row stride, as the KV
    store kernels read them (a single row's stride is never read: views of one row differ there)."""
    return (rows_of_heads(k) and rows_of_heads(v) and k.shape == v.shape
            and (k.shape[0] == 1 or k.stride(0) == v.stride(0)))


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotary_ref.rotate_signed_ref(x, cos, signed_sin)` written into `x [T, heads, D]` (a view
    with contiguous rows of heads, e.g. into the fused qkv output); returns x."""
    if not rows_of_heads(x):
        raise ValueError("x must be [T, heads, D] with contiguous heads in each row")
    rotary = _functions(x.dtype)[2]
    cos = cos.to(x.dtype).reshape(x.shape[0], x.shape[2]).contiguous()
    sin = signed_sin.to(x.dtype).reshape(x.shape[0], x.shape[2]).contiguous()
    rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2])
    return x


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """As `kv_cache_ref.store_kv_cache_ref` for contiguous caches: k, v [T, kv_heads, D] views
    with contiguous rows and the same strides; slot_mapping [T] int64, -1 = skip."""
    if not (same_rows(k, v) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("store_kv needs contiguous caches and k/v rows of the caches' dtype")
    slots = slot_mapping.to(torch.int64).contiguous()
    row_bytes = k.shape[1] * k.shape[2] * k.element_size()
    _functions(k.dtype)[3](k.data_ptr(), v.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           k.shape[0], k.stride(0) * k.element_size(), row_bytes)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """As `kv_cache_ref.store_kv_cache_ref` into contiguous fp8 caches (e4m3fn or e5m2) with
    per-tensor scales: k, v [T, kv_heads, D] rows of heads with the same strides."""
    if not (same_rows(k, v) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k.dtype == v.dtype and k_cache.dtype == v_cache.dtype in FP8_MAX):
        raise ValueError("store_kv_fp8 needs contiguous fp8 caches and k/v rows of one dtype")
    slots = slot_mapping.to(torch.int64).contiguous()
    _functions(k.dtype)[4](k.data_ptr(), v.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                           k.shape[0], k.stride(0), k.shape[1] * k.shape[2], k_cache.dtype == torch.float8_e5m2,
                           inverse_scale(k_scale), inverse_scale(v_scale))


_BITMASK = ("apply_token_bitmask_f32", 4, 4)   # (function, pointers, ints) of the logits kernels
_SAMPLE = ("sample_rows_f32", 5, 3)


@cpu_build.per_isa
def _logits_function(name: str, pointers: int, ints: int) -> object | None:
    library = cpu_build.load("fused_cpu")
    return None if library is None else cpu_build.bind(library, name, pointers=pointers, ints=ints)


def _takes_logits(logits: torch.Tensor, kernel: tuple[str, int, int]) -> bool:
    """Whether `kernel` takes these logits: CPU float32 rows with unit column stride, kernels built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and _logits_function(*kernel) is not None)


def token_bitmask_available(logits: torch.Tensor) -> bool:
    """Whether `apply_token_bitmask` takes these logits."""
    return _takes_logits(logits, _BITMASK)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Set `logits[r, j]` to -inf where bit j of `bitmask[r]` (int32 words, xgrammar's layout)
    is clear, for each r in `rows` and j < logits.shape[1]; returns a bool per listed row: whether
    any allowed token's logit is still above -inf."""
    if not token_bitmask_available(logits) or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1 \
            or bitmask.shape[1] * 32 < logits.shape[1] or bitmask.shape[0] < logits.shape[0]:
        raise ValueError("apply_token_bitmask needs CPU float32 logits and an int32 bitmask covering them")
    if rows and not (0 <= min(rows) and max(rows) < logits.shape[0]):
        raise ValueError(f"rows must index the {logits.shape[0]} rows of logits")
    index = torch.tensor(rows, dtype=torch.int64)
    alive = torch.zeros(len(rows), dtype=torch.uint8)
    _logits_function(*_BITMASK)(logits.data_ptr(), bitmask.data_ptr(), index.data_ptr(), alive.data_ptr(), len(rows),
                                logits.stride(0), bitmask.stride(0), logits.shape[1])
    return alive.bool()


def sample_rows_available(logits: torch.Tensor) -> bool:
    """Whether `sample_rows` takes these logits."""
    return _takes_logits(logits, _SAMPLE)


def sample_rows(logits: torch.Tensor, rows: list[int], temperatures: list[float], uniform: torch.Tensor
                ) -> torch.Tensor:
    """For each listed row r: the first token j whose cumulative `softmax(logits[r] / T)` exceeds
    `uniform[i]` (the rule of `sampler._inverse_transform`, in one pass); `logits.shape[1]`
    for a row that cannot be sampled (all -inf, NaN or +inf). Returns int64 [len(rows)]."""
    if not sample_rows_available(logits):
        raise ValueError("sample_rows needs CPU float32 logits with unit column stride")
    if rows and not (0 <= min(rows) and max(rows) < logits.shape[0]):
        raise ValueError(f"rows must index the {logits.shape[0]} rows of logits")
    if len(temperatures) != len(rows) or uniform.numel() != len(rows) or min(temperatures, default=1.0) <= 0.0:
        raise ValueError("sample_rows needs a positive temperature and a uniform number per row")
    index = torch.tensor(rows, dtype=torch.int64)
    inverse = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
    draws = uniform.to(torch.float32).reshape(-1).contiguous()
    tokens = torch.empty(len(rows), dtype=torch.int64)
    _logits_function(*_SAMPLE)(logits.data_ptr(), inverse.data_ptr(), draws.data_ptr(), tokens.data_ptr(),
                               index.data_ptr(), len(rows), logits.stride(0), logits.shape[1])
    return tokens
