"""Build and load the plain-C CPU kernels of this folder (`*_cpu.c`), once per machine.

Why C on the CPU path: torch's CPU ops cost 5-20 us each in dispatch and threading, and the
engine's per-layer glue (norms, activation, paged attention) is dozens of them per layer. These
files include no torch headers, so a build takes 1-7 s with the system C compiler (no
multi-minute C++ extension build). The shared object is cached under
`$KUBEINFER_CACHE_DIR/kernels` (default `~/.cache/kubeinfer/kernels`), keyed on the source,
the headers it may include (`cpu_math.h`), flags, compiler and the CPU's feature flags
(-march=native code only runs on the same features). It links the OpenMP runtime torch has already loaded (`libgomp.so.1`), so `torch.set_num_threads`
governs these kernels too. Without a compiler `load` returns None and callers keep torch;
`KUBEINFER_CPU_KERNELS=0` forces that.
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
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# In the order a starting server needs them: quant_pack while loading weights, the fused ops at
# the first forward, decode attention only once a first token exists (see `building`).
KERNELS = ("quant_linear_cpu", "fused_cpu", "paged_decode_cpu")
BACKGROUND_NICENESS = 10
_LOCKS = {name: threading.Lock() for name in KERNELS}
_BACKGROUND: dict[str, Future] = {}
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared",
          "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


def cache_dir() -> Path:
    root = os.environ.get("KUBEINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeinfer")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def _build(source: Path, compiler: str) -> Path:
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, *CFLAGS, _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *CFLAGS, str(source), "-o", str(built), "-lm"],
                           check=True, capture_output=True, text=True)
            built.replace(target)   # atomic: concurrent builders never load a half-written file
        for stale in target.parent.glob(f"{source.stem}-*.so"):   # older sources' builds
            if stale != target:
                stale.unlink(missing_ok=True)   # a process that loaded it keeps its mapping
        log.info("built CPU kernels %s", target)
    return target


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
        return _compiled(name)


@cache
def _compiled(name: str) -> Path | None:
    if os.environ.get("KUBEINFER_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU kernels %s unavailable, using the slower torch ops", name)
        return None
    try:
        return _build(Path(__file__).with_name(f"{name}.c"), compiler)
    except (OSError, subprocess.CalledProcessError) as error:
        log.warning("CPU kernels %s unavailable (%s): using torch ops", name, getattr(error, "stderr", "") or error)
        return None


@cache
def start_building() -> None:
    """Build (or find) every CPU kernel in two background threads, in `KERNELS` order, at a lower
    CPU priority; `load` then waits for a build still running. It only compiles: loading links
    libgomp, which must be the one torch loads (see the module docstring), so this is safe before
    `import torch`. `kubeinfer serve` calls it first, so a fresh pod (its cache is an emptyDir)
    compiles while it imports torch and loads weights, and decodes in torch until decode
    attention's kernel is built (`building`). The niceness keeps the compilers (~7 CPU-seconds,
    4.5-7.5 of them decode attention's) from slowing that critical path on 2 cores. Offline
    engines (tests, `generate`, `bench throughput`) do not call it: they build each kernel at
    its first use and never run a step without it, so their results do not depend on timing."""
    pool = ThreadPoolExecutor(2, thread_name_prefix="kubeinfer-cc", initializer=_lower_priority)
    for name in KERNELS:
        _BACKGROUND[name] = pool.submit(compiled, name)
    pool.shutdown(wait=False)


def _lower_priority() -> None:
    try:   # Linux: per thread, and the compiler processes it forks inherit it
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICENESS))
    except (AttributeError, OSError):
        pass


def building(name: str) -> bool:
    """Whether `start_building`'s compile of `name` is still running: callers with a fallback
    check this to go on without the kernel instead of blocking in `load`."""
    future = _BACKGROUND.get(name)
    return future is not None and not future.done()


def bind(library: ctypes.CDLL, name: str, pointers: int, ints: int, floats: int = 0) -> ctypes._CFuncPtr:
    """`library.name` typed as (pointers..., int64 ints..., floats...) -> int status."""
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * ints + [ctypes.c_float] * floats
    return function
