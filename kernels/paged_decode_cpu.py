"""CPU paged-attention decode: `paged_decode_cpu.c`, compiled once per machine and called via ctypes.

Why C and not torch: on CPU, decode attention in torch must first gather each sequence's K/V
out of the paged cache into a padded copy and then run SDPA, whose CPU kernel is built for
long queries; at 32 sequences x 260 tokens that was ~1.3 ms per layer, ~40 ms of a 120 ms step.
The C kernel reads K/V in place. It has no torch headers (a plain shared object, ~1 s to
build with the system C compiler) and shares torch's OpenMP runtime (`libgomp.so.1`, already
loaded by torch), so `torch.set_num_threads` governs it too. Without a C compiler, `available()`
is False and callers keep the torch path; `KUBEINFER_CPU_KERNELS=0` forces that.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_FUNCTIONS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def cache_dir() -> Path:
    root = os.environ.get("KUBEINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeinfer")
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """-march=native code is only valid on CPUs with the same features: key the build on them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return flags


def _build(compiler: str) -> Path:
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *CFLAGS, _cpu_signature()])
                         .encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_decode_cpu-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"],
                           check=True, capture_output=True, text=True)
            built.replace(target)   # atomic: concurrent builders never load a half-written file
        log.info("built the CPU attention kernel: %s", target)
    return target


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KUBEINFER_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention stays on the slower torch path")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("CPU attention kernel unavailable (%s): using the torch path", detail)
        return None
    for name in _FUNCTIONS.values():
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return library


def available(dtype: torch.dtype) -> bool:
    """Whether `paged_decode` runs for CPU tensors of `dtype` (builds the kernel on first call)."""
    return dtype in _FUNCTIONS and _library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query per sequence, `q [S, H, D]`, over its first `seq_lens[s]` cached
    tokens (the last `sliding_window` of them if set); returns `[S, H, D]` in q's dtype.
    `block_tables [S, max_blocks]` and `seq_lens [S]` are int32, the caches as in the README."""
    library = _library()
    if library is None or q.dtype not in _FUNCTIONS:
        raise RuntimeError(f"CPU decode kernel unavailable for {q.dtype}; check available() first")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != q.dtype:
        raise ValueError("k_cache and v_cache must be contiguous and of q's dtype")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    status = getattr(library, _FUNCTIONS[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        tables.shape[1], scale, sliding_window or 0)
    if status:
        raise ValueError(f"CPU decode kernel refused the shapes (status {status}): heads {num_heads}, "
                         f"kv_heads {k_cache.shape[2]}, head_dim {head_dim}")
    return out
