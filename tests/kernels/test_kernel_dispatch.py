"""`kubeinfer.kernels.ops`: torch on CPU by default, Triton when forced, same answers either way."""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels import ops
from kubeinfer.kernels.reference.attention_ref import paged_attention_ref

pytestmark = pytest.mark.unit


def _all_ops():
    """Run every backend-dispatched op; returns every output tensor."""
    x = torch.linspace(-2, 2, 3 * 64).view(3, 64)
    normed, residual = ops.rms_norm(x, torch.ones(64), 1e-6, residual=x)
    cache = ops.build_rope_cache(64, 64, 10000.0)
    q, k = ops.apply_rotary(x.view(3, 1, 64), x.view(3, 1, 64), torch.tensor([0, 1, 63]), cache)
    return [normed, residual, q, k, ops.silu_and_mul(x)]


def test_cpu_tensors_use_torch_unless_triton_is_forced():
    x = torch.zeros(1)
    assert not ops.uses_triton(x)
    with ops.use_backend("triton"):
        assert ops.uses_triton(x)
        with ops.use_backend("torch"):
            assert not ops.uses_triton(x)
    assert not ops.uses_triton(x)


def test_both_backends_agree():
    want = _all_ops()
    with ops.use_backend("triton"):
        got = _all_ops()
    for got_tensor, want_tensor in zip(got, want):
        torch.testing.assert_close(got_tensor, want_tensor, atol=1e-4, rtol=1e-4)


def test_long_decode_picks_split_kv_and_prefill_never_does():
    cpu = torch.device("cpu")
    assert ops.choose_num_splits(1, 8, 32768, 1, cpu) > 1
    assert ops.choose_num_splits(1, 8, 32768, 7, cpu) == 1
    assert ops.choose_num_splits(1, 8, 300, 1, cpu) == 1        # too short to be worth a merge
    assert ops.choose_num_splits(256, 8, 32768, 1, cpu) == 1    # the batch already fills the GPU


@pytest.mark.parametrize("num_splits", [None, 1, 2])
def test_triton_paged_attention_unified_or_split_matches_the_reference(triton_backend, num_splits):
    kinds = {None: BATCH_KINDS["mixed"], 1: BATCH_KINDS["mixed"], 2: [(1, 60), (1, 3)]}
    batch = make_paged_batch(kinds[num_splits], 8, 2, 64, 16, torch.float32)
    got = ops.triton_paged_attention(*batch.args(), 0.125, max_query_len=batch.max_query_len,
                                     max_seq_len=batch.max_seq_len, num_splits=num_splits)
    torch.testing.assert_close(got, paged_attention_ref(*batch.args(), 0.125), atol=1e-4, rtol=1e-4)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        with ops.use_backend("cuda"):
            pass
