"""The CPU KV cache the model runner allocates: zeroed, aligned, and its pages mapped lazily."""

import os

import pytest
import torch

from kubeinfer.server.engine.model_runner import _lazy_cpu_zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_lazy_zeros_are_zero_aligned_and_writable(dtype):
    cache = _lazy_cpu_zeros((37, 16, 3, 64), dtype)
    assert cache.shape == (37, 16, 3, 64) and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % 64 == 0   # the C kernels' 64-byte rows never straddle cache lines
    assert not cache.any()
    cache[5, 3] = 1.5
    assert cache.sum().item() == 1.5 * 3 * 64


def test_pages_are_mapped_on_first_touch():
    """Allocating 256 MiB must not grow the resident set by that much (torch.zeros would)."""
    before = _resident_bytes()
    cache = _lazy_cpu_zeros((1 << 27,), torch.bfloat16)
    assert _resident_bytes() - before < 64 << 20
    cache[::4096].fill_(1)   # touch every 8 KiB: now it is resident
    assert _resident_bytes() - before > 200 << 20
    assert cache.sum().item() == (1 << 27) // 4096


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
