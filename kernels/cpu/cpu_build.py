"""Build and load the plain-C CPU kernels of this folder (`*_cpu.c`), once per machine.

Why C on the CPU path: torch's CPU ops cost 5-20 us each in dispatch and threading, and the
engine's per-layer glue (norms, activation, paged attention) is dozens of them per layer. These
files include no torch headers, so a build takes 1-7 s with the system C compiler (no
multi-minute C++ extension build). The shared object is cached under
`$KUBEINFER_CACHE_DIR/kernels` (default `~/.cache/kubeinfer/kernels`), keyed on the source,
the headers it may include (`cpu_math.h`, `amx_tiles.h`), flags, compiler and the CPU's feature flags
(-march=native code only runs on the same features). It links the OpenMP runtime torch has already loaded (`libgomp.so.1`), so `torch.set_num_threads`
governs these kernels too. Without a compiler `load` returns None and callers keep torch;
`KUBEINFER_CPU_KERNELS=0` forces that.

`KUBEINFER_CPU_ISA` builds for less than this CPU has, so the paths other CPUs take run (and are
tested) here too: `native` (default: all this CPU has, AMX included), `avx512` (no AMX: an AMD
EPYC with AVX512-BF16) or `avx2` (no AVX-512). Each variant is cached apart; `forced_isa` switches
a process over (tests), clearing what the kernel modules cached per variant (`per_isa`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

KERNELS = ("quant_linear_cpu", "fused_cpu", "paged_decode_cpu", "paged_prefill_cpu", "lora_cpu", "int8_linear_cpu")
# What a starting server needs before its first token: quant_pack and the GGUF dequantization
# while weights load, the fused ops at the first forward. The attention kernels come later.
LOADING_KERNELS = ("quant_linear_cpu", "fused_cpu")
_LOCKS = {name: threading.Lock() for name in KERNELS}
_BACKGROUND: dict[str, Future] = {}
_BACKGROUND_LOCK = threading.Lock()
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared",
          "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
# variant -> (flags added to CFLAGS, /proc/cpuinfo flags it needs); -mno-avx512f drops every AVX-512 part.
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "native": ((), ()),
    "avx512": (_NO_AMX, ("avx512f", "avx512_bf16")),
    "avx2": (("-mno-avx512f", *_NO_AMX), ("avx2",)),
}
# A build no process has used for a week is an older source's: its file is deleted.
UNUSED_SECONDS = 7 * 24 * 3600
_PER_ISA: list = []
F = TypeVar("F", bound=Callable)


def isa() -> str:
    """The variant this process builds and loads (`KUBEINFER_CPU_ISA`, default native)."""
    name = os.environ.get("KUBEINFER_CPU_ISA", "native")
    if name not in ISAS:
        raise ValueError(f"KUBEINFER_CPU_ISA={name!r}: expected one of {', '.join(ISAS)}")
    return name


def missing_cpu_flags(name: str) -> list[str]:
    """The instruction-set flags variant `name` needs that this CPU lacks."""
    have = set(_cpu_flags().split())
    return [flag for flag in ISAS[name][1] if flag not in have]


def per_isa(function: F) -> F:
    """`functools.cache`, emptied when `forced_isa` switches variants (kernel modules' bindings)."""
    cached = cache(function)
    _PER_ISA.append(cached)
    return cached  # type: ignore[return-value]


@contextmanager
def forced_isa(name: str) -> Iterator[None]:
    """Build and load variant `name` inside the block (tests); the previous one after it."""
    before = os.environ.get("KUBEINFER_CPU_ISA")
    os.environ["KUBEINFER_CPU_ISA"] = name
    _clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KUBEINFER_CPU_ISA", None)
        else:
            os.environ["KUBEINFER_CPU_ISA"] = before
        _clear()


def _clear() -> None:
    for cached in _PER_ISA:
        cached.cache_clear()


def cache_dir() -> Path:
    root = os.environ.get("KUBEINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeinfer")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def _build(source: Path, compiler: str, variant: str = "native") -> Path:
    flags = [*CFLAGS, *ISAS[variant][0]]
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, *flags, _cpu_flags()]).encode()).hexdigest()
    stem = source.stem if variant == "native" else f"{source.stem}.{variant}"  # variants never replace each other
    target = cache_dir() / f"{stem}-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"],
                           check=True, capture_output=True, text=True)
            built.replace(target)   # atomic: concurrent builders never load a half-written file
        log.info("built CPU kernels %s", target)
    os.utime(target)   # in use: `_forget_unused` keeps it
    _forget_unused(target.parent, stem, keep=target)
    return target


def _forget_unused(folder: Path, stem: str, keep: Path) -> None:
    """Delete builds of `stem` from other sources that no process has used for UNUSED_SECONDS.

    Not every other build: two versions can share one cache (a node's hostPath cache during a
    rolling upgrade, a before/after benchmark), and deleting the other's fresh build between its
    `_build` and its dlopen sent that server to the torch ops at half the speed for its lifetime.
    """
    for other in folder.glob(f"{stem}-*.so"):
        try:
            if other != keep and time.time() - other.stat().st_mtime > UNUSED_SECONDS:
                other.unlink()   # a process that loaded it keeps its mapping
        except FileNotFoundError:   # another process forgot it first
            pass


def load(name: str) -> ctypes.CDLL | None:
    """The compiled `kernels/<name>.c`, or None (logged once) if it cannot be built here."""
    path = compiled(name)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        log.warning("CPU kernels %s unavailable (%s): using torch ops", name, error)
        return None


def compiled(name: str) -> Path | None:
    """The shared object of `kernels/<name>.c`, built if needed, without loading it."""
    with _LOCKS[name]:   # a caller and `start_building`'s thread never compile the same file twice
        return _compiled(name, isa())


@cache
def _compiled(name: str, variant: str) -> Path | None:
    if os.environ.get("KUBEINFER_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU kernels %s unavailable, using the slower torch ops", name)
        return None
    try:
        return _build(Path(__file__).with_name(f"{name}.c"), compiler, variant)
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("CPU kernels %s unavailable (%s): using torch ops", name, getattr(error, "stderr", "") or error)
        return None


def start_building(names: tuple[str, ...] = KERNELS) -> None:
    """Build (or find) these CPU kernels one after the other in a background thread, skipping any
    already started; `load` then waits for a build still running. It only compiles: loading links
    libgomp, which must be the one torch loads (see the module docstring), so this is safe before
    `import torch`.

    `kubeinfer serve` builds LOADING_KERNELS while it imports torch and loads weights (a fresh
    pod's cache is an emptyDir), then the rest once its engine is up, and attends in torch
    until the attention kernels are built (`building`): decode's 4.5-7.5 s of gcc, run during the
    load, slowed a first start on 2 cores by 1.5-2 s, and run at a lower priority it starved
    behind a loaded engine for more than 30 s. Offline engines (tests, `generate`, `bench
    throughput`) do not call it: they build each kernel at its first use and never run a step
    without it, so their results do not depend on timing."""
    with _BACKGROUND_LOCK:
        for name in names:
            if name not in _BACKGROUND:
                _BACKGROUND[name] = _builder().submit(compiled, name)


@cache
def _builder() -> ThreadPoolExecutor:
    """The one background build thread: builds queue behind each other."""
    return ThreadPoolExecutor(1, thread_name_prefix="kubeinfer-cc")


def building(name: str) -> bool:
    """Whether `start_building`'s compile of `name` is still running: callers with a fallback
    check this to go on without the kernel instead of blocking in `load`."""
    future = _BACKGROUND.get(name)
    return future is not None and not future.done()


class _Recording(threading.local):
    calls: list[tuple[ctypes._CFuncPtr, tuple]] | None = None


_RECORDING = _Recording()


class Kernel:
    """A bound C entry point, called as the ctypes function is. While `recording_calls` is open on
    the calling thread, each call is also kept with its arguments: a decode step replayed from
    that list skips the Python that computed them (server/engine/cpu_graphs.py)."""

    __slots__ = ("function",)

    def __init__(self, function: ctypes._CFuncPtr) -> None:
        self.function = function

    def __call__(self, *args: object) -> int:
        calls = _RECORDING.calls
        if calls is not None:
            calls.append((self.function, args))
        return self.function(*args)


@contextmanager
def recording_calls() -> Iterator[list[tuple[ctypes._CFuncPtr, tuple]]]:
    """The kernel calls made on this thread inside the block, in order: (ctypes function,
    arguments) pairs; pointers in them stay valid only while their tensors live."""
    calls: list[tuple[ctypes._CFuncPtr, tuple]] = []
    previous, _RECORDING.calls = _RECORDING.calls, calls
    try:
        yield calls
    finally:
        _RECORDING.calls = previous


def bind(library: ctypes.CDLL, name: str, pointers: int, ints: int, floats: int = 0) -> Kernel:
    """`library.name` typed as (pointers..., int64 ints..., floats...) -> int status."""
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * ints + [ctypes.c_float] * floats
    return Kernel(function)
