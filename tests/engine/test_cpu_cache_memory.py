"""The CPU KV cache's memory: zeroed, aligned, not written at allocation, mapped in the background."""

import os

import pytest
import torch

from kubeinfer.server.engine.cpu_cache_memory import lazy_zeros, map_in_background


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_lazy_zeros_are_zero_aligned_and_writable(dtype):
    cache = lazy_zeros((37, 16, 3, 64), dtype)
    assert cache.shape == (37, 16, 3, 64) and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0   # the C kernels' 64-byte rows never straddle cache lines
    assert not cache.any()
    cache[5, 3] = 1.5
    assert cache.sum().item() == 1.5 * 3 * 64


def test_allocation_writes_nothing_and_the_background_thread_maps_it():
    """256 MiB: resident only once mapped (torch.zeros would write it all at once), still zero,
    and what was written before the mapping survives it."""
    before = _resident_bytes()
    cache = lazy_zeros((1 << 27,), torch.bfloat16)
    assert _resident_bytes() - before < 64 << 20
    cache[12345] = 3.0
    map_in_background([cache]).join(timeout=60)
    assert _resident_bytes() - before > 200 << 20
    assert cache[12345].item() == 3.0 and cache.count_nonzero().item() == 1


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
