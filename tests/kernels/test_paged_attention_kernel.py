"""The unified paged attention kernel against the torch reference, under the interpreter.

float32 and float16 only: the interpreter computes with numpy, which has no bfloat16
arithmetic, so bf16 is exercised on a GPU (`kubeinfer bench-kernels`), not here.
"""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels.reference.attention_ref import paged_attention_ref
from kubeinfer.kernels.triton.unified_attention import unified_attention

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-3, torch.float16: 1.5e-2}   # atol = rtol
HEAD_RATIOS = [(8, 8), (8, 2), (5, 1), (32, 8)]


def _check(batch, **options):
    got = unified_attention(*batch.args(), 0.125, max_query_len=batch.max_query_len, **options)
    want = paged_attention_ref(*batch.args(), 0.125, **options)
    tol = TOLERANCES[batch.q.dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", list(BATCH_KINDS))
@pytest.mark.parametrize("heads", HEAD_RATIOS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_matches_reference_over_head_ratios_and_batch_kinds(heads, kind, dtype):
    _check(make_paged_batch(BATCH_KINDS[kind], *heads, head_dim=64, block_size=16, dtype=dtype))


@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (128, 32)])
@pytest.mark.parametrize("kind", list(BATCH_KINDS))
def test_matches_reference_over_head_dims_and_block_sizes(head_dim, block_size, kind):
    _check(make_paged_batch(BATCH_KINDS[kind], 8, 2, head_dim, block_size, torch.float16, seed=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_and_softcap(dtype):
    batch = make_paged_batch(BATCH_KINDS["mixed"], 8, 2, 64, 16, dtype, seed=2)
    _check(batch, sliding_window=10)
    _check(batch, softcap=2.0)
    _check(batch, sliding_window=1, softcap=30.0)


def test_head_dim_not_a_power_of_two():
    _check(make_paged_batch(BATCH_KINDS["mixed"], 4, 2, 80, 16, torch.float32, seed=3))


def test_queries_as_views_of_a_fused_qkv_output():
    """The model rotates q in place inside its qkv projection output: rows are strided."""
    batch = make_paged_batch(BATCH_KINDS["mixed"], 8, 2, 64, 16, torch.float32, seed=5)
    qkv = torch.randn(batch.q.shape[0], (8 + 2 + 2) * 64)
    qkv[:, :512] = batch.q.flatten(1)
    batch.q = qkv[:, :512].view(-1, 8, 64)
    assert not batch.q.is_contiguous()
    _check(batch)


def test_padding_rows_past_the_last_sequence_are_left_alone():
    batch = make_paged_batch(BATCH_KINDS["decode"], 8, 2, 64, 16, torch.float32)
    batch.q = torch.cat([batch.q, torch.randn(3, 8, 64)])   # CUDA-graph style padding tokens
    out = torch.full_like(batch.q, 7.0)
    unified_attention(*batch.args(), 0.125, max_query_len=1, out=out)
    assert (out[-3:] == 7.0).all()
    torch.testing.assert_close(out[:-3], paged_attention_ref(*batch.args(), 0.125)[:-3])


@pytest.mark.parametrize("heads", HEAD_RATIOS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_long_chunked_prefill_with_deep_prefix(heads):
    lengths = [(70, 130), (1, 300), (45, 0)]
    _check(make_paged_batch(lengths, *heads, head_dim=128, block_size=32, dtype=torch.float16, seed=4))


def test_bad_layout_is_rejected_with_a_clear_error():
    batch = make_paged_batch(BATCH_KINDS["decode"], 6, 4, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="cannot share"):
        unified_attention(*batch.args(), 0.125, max_query_len=1)
    batch = make_paged_batch(BATCH_KINDS["decode"], 8, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="dtype mismatch"):
        unified_attention(batch.q.half(), *batch.args()[1:], 0.125, max_query_len=1)
