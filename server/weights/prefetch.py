"""Start reading a model's weight files into the page cache while the engine still imports.

A new replica spends its first seconds importing torch and the engine (no disk I/O), then
reads every weight byte. Asking the kernel for the files first (posix_fadvise WILLNEED, from a
background thread: the call blocks while it queues the reads) lets the disk work during the
imports, so the loader finds the pages cached. Bounded by half the memory available, so a model
larger than memory does not push its own first pages out before they are used. Torch-free.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("kubeinfer.prefetch")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")


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
    for file, size in planned:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        except OSError as exc:   # a file system without readahead: the loader reads it anyway
            logger.debug("prefetching %s: %s", file, exc)
        finally:
            os.close(fd)


def prefetch(model: str) -> threading.Thread | None:
    """Read `model`'s weights (a model directory or a weight file) into the page cache in the
    background; None when there is nothing to read or no memory to spare."""
    path = Path(model)
    if not path.exists() or not hasattr(os, "posix_fadvise"):
        return None
    planned = plan(path, (available_memory() or 0) // 2)
    if not planned:
        return None
    thread = threading.Thread(target=_read_ahead, args=(planned,), name="weights-prefetch", daemon=True)
    thread.start()
    logger.info("reading %d bytes of %s ahead of the load", sum(size for _, size in planned), path)
    return thread
