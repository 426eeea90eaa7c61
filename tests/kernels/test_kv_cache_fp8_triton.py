"""The Triton KV store and paged attention kernels over an fp8 cache, under the interpreter
(float32 and float16 compute, fp8 e4m3 / e5m2 storage): the store quantizes as
`kv_cache_ref.quantize_fp8_ref` bit for bit, attention equals the torch reference over the same
fp8 cache times its per-tensor scales.
"""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels.reference.attention_ref import paged_attention_ref
from kubeinfer.kernels.reference.kv_cache_ref import quantize_fp8_ref, store_kv_cache_ref
from kubeinfer.kernels.triton.kv_cache import store_kv_cache
from kubeinfer.kernels.triton.split_kv_attention import split_kv_attention
from kubeinfer.kernels.triton.unified_attention import unified_attention

pytestmark = pytest.mark.integration

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.37, 2.5
TOLERANCES = {torch.float32: 1e-3, torch.float16: 1.5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_store_quantizes_like_the_reference(dtype, kv_dtype):
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(40, 3, 80, generator=gen) * torch.logspace(-7, 4, 40)[:, None, None])
    k[0, 0, :5] = torch.tensor([1e6, -1e6, 448.1 * K_SCALE, 0.0, -0.0])   # saturate; both zeros
    k = k.clamp(-6e4, 6e4).to(dtype)   # float16's range
    v = k.flip(0) * 3
    slots = torch.randperm(64, generator=gen)[:40]
    slots[5] = -1
    got = [torch.zeros(4, 16, 3, 80, dtype=kv_dtype) for _ in range(2)]
    want = [cache.clone() for cache in got]
    store_kv_cache(k, v, *got, slots, K_SCALE, V_SCALE)
    store_kv_cache_ref(k, v, *want, slots, K_SCALE, V_SCALE)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fp8_batch(kind, dtype, kv_dtype, heads=(8, 2), seed=0):
    batch = make_paged_batch(BATCH_KINDS[kind], *heads, 64, 16, dtype, seed=seed)
    batch.k_cache = quantize_fp8_ref(batch.k_cache, K_SCALE, kv_dtype)
    batch.v_cache = quantize_fp8_ref(batch.v_cache, V_SCALE, kv_dtype)
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("kind", list(BATCH_KINDS))
def test_unified_attention_reads_fp8(dtype, kv_dtype, kind):
    batch = _fp8_batch(kind, dtype, kv_dtype)
    got = unified_attention(*batch.args(), 0.125, max_query_len=batch.max_query_len, k_scale=K_SCALE,
                            v_scale=V_SCALE)
    want = paged_attention_ref(*batch.args(), 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_split_kv_attention_reads_fp8(kv_dtype):
    batch = _fp8_batch("decode", torch.float16, kv_dtype, heads=(5, 1), seed=1)
    got = split_kv_attention(*batch.args(), 0.125, num_splits=3, sliding_window=20, k_scale=K_SCALE,
                             v_scale=V_SCALE)
    want = paged_attention_ref(*batch.args(), 0.125, sliding_window=20, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, want, atol=1.5e-2, rtol=1.5e-2)
