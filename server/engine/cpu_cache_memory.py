"""CPU memory for the KV cache: zeroed without writing it, mapped off the startup path.

`torch.zeros` writes every byte before the engine can start: 0.37 s of cold start for the default
1 GiB cache. Here the cache comes from `calloc` (numpy's zeros), whose large allocations are fresh
zero pages the kernel maps on first write, and a background thread then asks the kernel to map
them all (`MADV_POPULATE_WRITE`, Linux 5.14+), which leaves their contents alone, so it may run
while the engine already writes K/V. Without it, every first write to a page during serving would
take a page fault inside a forward pass. The cache asks for transparent huge pages first: decode
attention reads 16-token blocks all over it, and with 4 KiB pages each block costs TLB misses
(BENCHMARKS.md, "Figures that were in code comments").
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)

_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_PAGE, _HUGE_PAGE = 4096, 2 << 20
_CHUNK = 64 << 20   # bytes mapped per call: a cache dropped meanwhile stops being mapped soon
_SAME_SIZE_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, 64-byte aligned CPU tensor whose pages are not mapped yet."""
    elements, align = int(np.prod(shape)), 64 // dtype.itemsize
    raw = np.zeros(elements + align, dtype=_SAME_SIZE_INT[dtype.itemsize])
    start = (-raw.ctypes.data % 64) // dtype.itemsize
    return torch.from_numpy(raw[start:start + elements]).view(dtype).view(shape)


def map_in_background(tensors: list[torch.Tensor]) -> threading.Thread:
    """Start mapping the pages of `tensors` (from `lazy_zeros`) in a daemon thread, which holds
    them only weakly (an engine dropped meanwhile frees its cache); returned so callers may wait.
    Where the kernel lacks MADV_POPULATE_WRITE, pages map on first write."""
    refs = [weakref.ref(tensor) for tensor in tensors]
    thread = threading.Thread(target=_populate, args=(refs,), name="kubeinfer-kv-map", daemon=True)
    thread.start()
    return thread


def _populate(refs: list[weakref.ref[torch.Tensor]]) -> None:
    # Lowest priority: on a 2-core machine this thread would otherwise stall one of the engine's
    # two OpenMP threads (the first request's forward took 0.27 s instead of 0.07 s).
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for ref in refs:
        at, end = _whole_pages(ref, _HUGE_PAGE)
        if at < end:   # decode attention reads blocks all over the cache: a TLB miss per 4 KiB page
            madvise(at, end - at, _MADV_HUGEPAGE)   # where THP is off or unsupported: 4 KiB pages, as before
        at, end = _whole_pages(ref)
        while at < end:
            if ref() is None:
                break
            size = min(_CHUNK, end - at)
            if madvise(at, size, _MADV_POPULATE_WRITE) != 0:
                log.debug("KV cache pages map on first write (madvise: errno %d)", ctypes.get_errno())
                return
            at += size


def _whole_pages(ref: weakref.ref[torch.Tensor], page: int = _PAGE) -> tuple[int, int]:
    """The address range of the whole `page`-sized pages inside the tensor (empty if it is gone)."""
    tensor = ref()
    if tensor is None:
        return 0, 0
    start = -(-tensor.data_ptr() // page) * page
    return start, (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
