"""Split-KV (flash-decoding) attention against the torch reference, under the interpreter.

float32 and float16 only: the interpreter has no bfloat16 arithmetic (numpy).
"""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels.reference.attention_ref import paged_attention_ref
from kubeinfer.kernels.triton.split_kv_attention import split_kv_attention

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-3, torch.float16: 1.5e-2}
LONG_DECODE = [(1, 90), (1, 37), (1, 0)]   # contexts of 91, 38 and 1 tokens


def _check(batch, num_splits, **options):
    got = split_kv_attention(*batch.args(), 0.125, num_splits=num_splits, **options)
    want = paged_attention_ref(*batch.args(), 0.125, **options)
    tol = TOLERANCES[batch.q.dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (5, 1), (32, 8)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_matches_reference(heads, dtype):
    _check(make_paged_batch(LONG_DECODE, *heads, head_dim=64, block_size=16, dtype=dtype), num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2, 5])   # 5 splits of a 3-tile context: some splits are empty
@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16)])
def test_split_counts_head_dims_and_block_sizes(num_splits, head_dim, block_size):
    _check(make_paged_batch(LONG_DECODE, 8, 2, head_dim, block_size, torch.float16, seed=1), num_splits)


def test_mixed_batch_with_window_and_softcap():
    batch = make_paged_batch(BATCH_KINDS["mixed"], 8, 2, 64, 16, torch.float32, seed=2)
    _check(batch, num_splits=2, sliding_window=12, softcap=5.0)


def test_long_context_decode():
    batch = make_paged_batch([(1, 700), (1, 333)], 32, 8, 128, 32, torch.float16, seed=3)
    _check(batch, num_splits=8)


def test_rejects_zero_splits():
    batch = make_paged_batch(LONG_DECODE, 8, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_attention(*batch.args(), 0.125, num_splits=0)
