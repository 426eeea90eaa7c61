"""Read a model's weight files into the page cache in the background, ahead of the loader.

A new replica spends its first seconds importing torch and the engine (no disk I/O), then
reads every weight byte; the loader then copies each tensor while the disk waits. A thread that
reads the files front to back (into one reused buffer: os.readinto releases the GIL) keeps the
disk busy during the imports and during the copies, so the loader mostly finds cached pages.
Why read rather than posix_fadvise / madvise WILLNEED: Linux caps those at the device's
readahead window (a few hundred KB to a few MB per call), so asking for a whole file reads
almost none of it. Bounded by half the memory available, so a model larger than memory does not
push its own first pages out before they are used. Started once per file per process. Torch-free.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

logger = logging.getLogger("kubeinfer.prefetch")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
BUFFER_BYTES = 16 << 20

_started: set[Path] = set()
_lock = threading.Lock()


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan(model: Path, budget_bytes: int) -> list[tuple[Path, int]]:
    """(file, bytes from its start to read ahead): the weight files in name order (shards load in
    that order), up to `budget_bytes` in all."""
    files = [model] if model.is_file() else sorted(p for p in model.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    planned = []
    for file in files:
        if budget_bytes <= 0:
            break
        size = min(file.stat().st_size, budget_bytes)
        planned.append((file, size))
        budget_bytes -= size
    return planned


def _read_ahead(planned: list[tuple[Path, int]]) -> None:
    view = memoryview(bytearray(BUFFER_BYTES))
    for file, size in planned:
        try:
            with open(file, "rb", buffering=0) as f:
                while size > 0 and (n := f.readinto(view[:min(size, BUFFER_BYTES)])):
                    size -= n
        except OSError as exc:   # the loader reads it anyway, and says what is wrong
            logger.debug("reading %s ahead: %s", file, exc)


def prefetch(model: str | Path) -> threading.Thread | None:
    """Read `model`'s weights (a model directory or a weight file) into the page cache in the
    background; None when there is nothing left to read or no memory to spare."""
    path = Path(model)
    if not path.exists():
        return None
    with _lock:
        planned = [(f, n) for f, n in plan(path, (available_memory() or 0) // 2) if f.resolve() not in _started]
        _started.update(f.resolve() for f, _ in planned)
    if not planned:
        return None
    thread = threading.Thread(target=_read_ahead, args=(planned,), name="weights-prefetch", daemon=True)
    thread.start()
    logger.info("reading %d bytes of %s ahead of the load", sum(size for _, size in planned), path)
    return thread
