"""The CPU KV cache's memory: zeroed, aligned, not written at allocation, mapped in the background."""

import ctypes
import weakref

import pytest
import torch

from kubeinfer.server.engine.cpu_cache_memory import lazy_zeros, map_in_background

pytestmark = pytest.mark.unit

PAGE = 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_lazy_zeros_are_zero_aligned_and_writable(dtype):
    cache = lazy_zeros((37, 16, 3, 64), dtype)
    assert cache.shape == (37, 16, 3, 64) and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0   # the C kernels' 64-byte rows never straddle cache lines
    assert not cache.any()
    cache[5, 3] = 1.5
    assert cache.sum().item() == 1.5 * 3 * 64


def test_allocation_writes_nothing_and_the_background_thread_maps_it():
    """256 MiB: no page resident at first (torch.zeros writes them all), every page once mapped,
    still zero, and what was written before the mapping survives it."""
    cache = lazy_zeros((1 << 27,), torch.bfloat16)
    assert _resident_fraction(cache) < 0.01
    cache[12345] = 3.0
    map_in_background([cache]).join(timeout=60)
    assert _resident_fraction(cache) == 1.0
    assert cache[12345].item() == 3.0 and cache.count_nonzero().item() == 1


def test_the_mapping_thread_does_not_keep_a_dropped_cache_alive():
    cache = lazy_zeros((1 << 26,), torch.bfloat16)
    alive = weakref.ref(cache)
    thread = map_in_background([cache])
    del cache
    thread.join(timeout=60)
    assert alive() is None and not thread.is_alive()


def _resident_fraction(tensor: torch.Tensor) -> float:
    """Of the whole pages inside `tensor`, the fraction the kernel has mapped (mincore)."""
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    pages = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // PAGE
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * PAGE, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / pages
