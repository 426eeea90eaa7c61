"""The fp8 KV cache in the kernels: the stores quantize as `kv_cache_ref.quantize_fp8_ref` (bit for
bit), and every attention kernel reading an fp8 cache equals the torch reference over the same
fp8 cache (its values times the per-tensor scales).

Unowned cache slots hold NaN in fp8 too, so a read past a sequence's end poisons the output.
"""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels.cpu import fused_cpu, paged_decode_cpu, paged_prefill_cpu
from kubeinfer.kernels.reference.attention_ref import paged_attention_ref
from kubeinfer.kernels.reference.kv_cache_ref import FP8_MAX, quantize_fp8_ref, store_kv_cache_ref

pytestmark = pytest.mark.integration

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.37, 2.5   # scales that move values across fp8's exponent range


def _fp8_batch(lengths, heads, kv_heads, head_dim, block_size, dtype, kv_dtype, seed=0):
    batch = make_paged_batch(lengths, heads, kv_heads, head_dim, block_size, dtype, seed=seed)
    batch.k_cache = quantize_fp8_ref(batch.k_cache, K_SCALE, kv_dtype)   # NaN stays NaN
    batch.v_cache = quantize_fp8_ref(batch.v_cache, V_SCALE, kv_dtype)
    return batch


def _reference(batch, scale, **options):
    return paged_attention_ref(*batch.args(), scale, k_scale=K_SCALE, v_scale=V_SCALE, **options)


def _store_inputs(dtype, kv_heads=2, head_dim=16):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(50, 1 + 2 * kv_heads, head_dim, generator=gen) * torch.logspace(-6, 4, 50)[:, None, None]
    qkv[0, 1, :5] = torch.tensor([1e6, -1e6, 448.1 * K_SCALE, 0.0, -0.0])   # saturate; both zeros
    qkv = qkv.to(dtype)
    slots = torch.randperm(64, generator=gen)[:50]
    slots[3] = -1
    return qkv[:, 1:1 + kv_heads], qkv[:, 1 + kv_heads:], slots   # k, v: strided views into a fused qkv


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_reference_quantization_saturates_and_rounds_to_nearest_even(kv_dtype):
    limit = FP8_MAX[kv_dtype]
    x = torch.tensor([2 * limit, -2 * limit, limit, 0.0, 1.0])
    assert quantize_fp8_ref(x, 1.0, kv_dtype).float().tolist() == [limit, -limit, limit, 0.0, 1.0]
    assert quantize_fp8_ref(torch.tensor([4.0]), 2.0, kv_dtype).float().item() == 2.0
    step = 0.125 if kv_dtype == torch.float8_e4m3fn else 0.25   # between 1 and 2
    ties = torch.tensor([1 + step / 2, 1 + 3 * step / 2])
    assert quantize_fp8_ref(ties, 1.0, kv_dtype).float().tolist() == [1.0, 1 + 2 * step]   # to the even mantissa


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 16), (3, 8)])   # rows of 32 values, and of 24 (a part vector)
def test_cpu_store_quantizes_like_the_reference(dtype, kv_dtype, kv_heads, head_dim):
    k, v, slots = _store_inputs(dtype, kv_heads, head_dim)
    got = [torch.zeros(4, 16, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2)]
    want = [cache.clone() for cache in got]
    fused_cpu.store_kv_fp8(k, v, *got, slots, K_SCALE, V_SCALE)
    store_kv_cache_ref(k, v, *want, slots, K_SCALE, V_SCALE)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("heads,head_dim,block_size", [((9, 3), 64, 16), ((8, 1), 128, 32), ((4, 2), 80, 16)])
@pytest.mark.parametrize("extra", [[], [(1, 0), (1, 64), (1, 5)]], ids=["6-seqs", "9-seqs"])
def test_cpu_decode_reads_fp8(dtype, kv_dtype, heads, head_dim, block_size, extra, two_threads):
    """On 2 threads, 6 sequences run as one task per (sequence, KV head), 9 as one task each
    (which asks for the next sequence's rows while it reads)."""
    lengths = BATCH_KINDS["decode"] + [(1, 200), (1, 17)] + extra
    batch = _fp8_batch(lengths, *heads, head_dim, block_size, dtype, kv_dtype)
    scale = head_dim ** -0.5
    assert paged_decode_cpu.available(dtype, kv_dtype)
    got = paged_decode_cpu.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                        batch.seq_lens, scale, None, K_SCALE, V_SCALE)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(batch, scale), atol=tol, rtol=tol)
    windowed = paged_decode_cpu.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                             batch.seq_lens, scale, 10, K_SCALE, V_SCALE)
    torch.testing.assert_close(windowed, _reference(batch, scale, sliding_window=10), atol=tol, rtol=tol)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_decode_reads_every_e4m3_key_value(head_dim, two_threads):
    """The bf16 reading of e4m3 keys (for vdpbf16ps) is exact, subnormals included: keys of
    random e4m3 bytes, and keys of subnormals and zeros only under queries large enough that
    they decide a peaked softmax (a wrong value there picks other keys); both match the float32
    reference to bf16 rounding."""
    gen = torch.Generator().manual_seed(1)
    scale = head_dim ** -0.5
    for exponent_mask, q_factor in ((0xFF, 1.0), (0x87, 3000.0)):
        batch = make_paged_batch([(1, 200), (1, 37)] * 5, 9, 3, head_dim, 16, torch.bfloat16, seed=1)
        codes = torch.randint(0, 256, batch.k_cache.shape, generator=gen, dtype=torch.int32) & exponent_mask
        codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)   # no NaN
        batch.k_cache = codes.to(torch.uint8).view(torch.float8_e4m3fn)
        batch.v_cache = quantize_fp8_ref(batch.v_cache, V_SCALE, torch.float8_e4m3fn)
        batch.q = (batch.q.float() * q_factor).to(torch.bfloat16)
        got = paged_decode_cpu.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                            batch.seq_lens, scale, None, K_SCALE, V_SCALE)
        torch.testing.assert_close(got, _reference(batch, scale), atol=1e-2, rtol=1e-2)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.cpu_isas("native", "avx512")   # AMX tiles where the CPU has them, and vdpbf16ps
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128)])
def test_cpu_prefill_reads_fp8(kv_dtype, heads, kv_heads, head_dim):
    lengths = [(32, 512), (200, 44), (1, 100), (17, 31), (33, 0)]
    batch = _fp8_batch(lengths, heads, kv_heads, head_dim, 16, torch.bfloat16, kv_dtype)
    starts = batch.query_start_loc[:-1]
    scale = head_dim ** -0.5
    assert paged_prefill_cpu.available(torch.bfloat16, head_dim, kv_dtype)
    got = paged_prefill_cpu.paged_prefill(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                          batch.query_start_loc[1:] - starts, starts, scale, K_SCALE, V_SCALE)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _reference(batch, scale), atol=2e-2, rtol=2e-2)
