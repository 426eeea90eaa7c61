"""The KV-cache store kernel against the torch reference, under the interpreter.

The store only moves bytes, so bfloat16 runs here too (the interpreter cannot do bf16
arithmetic, but it copies bf16 exactly).
"""

import pytest
import torch

from kubeinfer.kernels.reference.kv_cache_ref import store_kv_cache_ref
from kubeinfer.kernels.triton.kv_cache import store_kv_cache

pytestmark = pytest.mark.integration


def _caches(num_blocks, block_size, kv_heads, head_dim, dtype):
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    return k_cache, torch.randn_like(k_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(8, 64, 16), (2, 128, 32), (1, 64, 16), (5, 80, 16)])
def test_store_matches_reference_and_skips_padding(kv_heads, head_dim, block_size, dtype):
    num_blocks = 6
    last_slot = num_blocks * block_size - 1   # the pool's final slot
    slots = torch.tensor([3, -1, block_size + 7, last_slot, 2 * block_size, -1, last_slot - block_size])
    k = torch.randn(len(slots), kv_heads, head_dim).to(dtype)
    v = torch.randn_like(k)
    got_k, got_v = _caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    store_kv_cache(k, v, got_k, got_v, slots)
    store_kv_cache_ref(k, v, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(got_k[-1, -1], k[3]) and torch.equal(got_v[0, 3], v[0])


def test_store_into_strided_cache_views():
    """A cache that is one half of a [blocks, 2, ...] allocation (K and V interleaved per block)."""
    both = torch.zeros(4, 2, 16, 2, 64)
    k_cache, v_cache = both[:, 0], both[:, 1]
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([0, 17, 63])
    store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(both[0, 0, 0], k[0]) and torch.equal(both[1, 1, 1], v[1]) and torch.equal(both[3, 0, 15], k[2])


def test_rejects_int32_slot_mapping():
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32)
    k = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="int64"):
        store_kv_cache(k, k, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))
