"""The CPU decode kernel (C, via ctypes) against the torch reference over the same paged cache.

Unowned cache slots hold NaN (see paged_batches.py), so a read past a sequence's end or through
a wrong block-table entry poisons the output.
"""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels.cpu import paged_decode_cpu
from kubeinfer.kernels.reference.attention_ref import paged_attention_ref

# every build variant: AMX, AVX-512 without AMX, AVX2
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cpu_isa")]

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}   # bf16: one rounding of the output
DECODES = BATCH_KINDS["decode"] + [(1, 0), (1, 200), (1, 16), (1, 17)]


def _check(batch, sliding_window=None) -> None:
    scale = batch.q.shape[-1] ** -0.5
    got = paged_decode_cpu.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                        batch.seq_lens, scale, sliding_window)
    want = paged_attention_ref(*batch.args(), scale, sliding_window=sliding_window)
    tol = TOLERANCES[batch.q.dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_builds_on_this_machine():
    """CI has a C compiler: the fast path must be the one the tests and benchmarks run."""
    assert paged_decode_cpu.available(torch.bfloat16) and paged_decode_cpu.available(torch.float32)
    assert not paged_decode_cpu.available(torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 8), (32, 4), (14, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 1), (80, 32)])
@pytest.mark.parametrize("seqs", [DECODES, DECODES[3:]], ids=["8-seqs", "5-seqs"])
def test_matches_reference(heads, head_dim, block_size, dtype, seqs, two_threads):
    """On 2 threads, 8 sequences run as one task each, 5 as one task per (sequence, KV head)."""
    _check(make_paged_batch(seqs, *heads, head_dim, block_size, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 10, 16, 500])
def test_sliding_window(window, dtype):
    """A window starts keys mid-block: partial runs before and after the 16-key tiles."""
    _check(make_paged_batch(DECODES, 8, 2, 64, 16, dtype, seed=3), sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_may_be_strided_views(dtype):
    """The model hands over q as a view into its fused qkv projection, read in place (rows 768
    elements apart, not 512)."""
    batch = make_paged_batch(DECODES, 8, 2, 64, 16, dtype, seed=5)
    qkv = torch.randn(batch.q.shape[0], 12 * 64).to(dtype)
    qkv[:, :512] = batch.q.flatten(1)
    batch.q = qkv[:, :512].view(-1, 8, 64)
    _check(batch)


def test_refuses_shapes_beyond_its_limits():
    batch = make_paged_batch(DECODES[:1], 64, 1, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="refused the shapes"):
        _check(batch)
