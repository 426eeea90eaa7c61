"""The multi-LoRA SGMV kernel (Triton, under the interpreter) and its torch reference against a
plain per-token loop: out[t] += x[t] @ A[slot(t)].T @ B[slot(t)].T, slot -1 = no delta."""

import pytest
import torch
from helpers.lora_adapters import per_token_delta

from kubeinfer.kernels import ops
from kubeinfer.kernels.reference.lora_ref import lora_shrink_expand_ref
from kubeinfer.kernels.triton.lora import lora_shrink_expand

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def _segments(slots_per_token: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Runs of equal slot, as the model builds them (`LoRABatch.set`)."""
    starts, slots = [0], []
    for i, slot in enumerate(slots_per_token):
        if i == 0 or slot != slots_per_token[i - 1]:
            if i:
                starts.append(i)
            slots.append(slot)
    starts.append(len(slots_per_token))
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32), longest


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden, out_features, rank, slots_per_token", [
    pytest.param(64, 96, 8, [0, 1, -1, 2, 1, 0], id="decode-bgmv-mixed-with-base"),
    pytest.param(96, 64, 16, [1] * 40 + [-1] * 5 + [0] * 19, id="prefill-segments-rank16"),
    pytest.param(72, 80, 48, [2] * 70 + [0] * 3, id="merged-rank-48-block-m-64"),
    pytest.param(64, 64, 8, [-1] * 9, id="base-only"),
    pytest.param(48, 200, 32, [3, 3, -1, -1, 3, 1] * 5, id="ragged-n-repeated-slot"),
])
def test_sgmv_matches_per_token_loop(hidden, out_features, rank, slots_per_token, dtype):
    generator = torch.Generator().manual_seed(rank)
    num_slots, tokens = 4, len(slots_per_token)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    a = (torch.randn(num_slots, rank, hidden, generator=generator) / hidden ** 0.5).to(dtype)
    b = (torch.randn(num_slots, out_features, rank, generator=generator) / rank ** 0.5).to(dtype)
    out = torch.randn(tokens, out_features, generator=generator).to(dtype)
    expected = per_token_delta(x, out, a, b, slots_per_token)
    starts, slots, longest = _segments(slots_per_token)
    tol = TOLERANCES[dtype]
    for got in (lora_shrink_expand(x, out.clone(), a, b, starts, slots, longest),
                lora_shrink_expand_ref(x, out.clone(), a, b, starts, slots)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    base_rows = [t for t, slot in enumerate(slots_per_token) if slot < 0]
    assert torch.equal(lora_shrink_expand(x, out.clone(), a, b, starts, slots, longest)[base_rows], out[base_rows])


def test_ops_dispatches_to_the_triton_kernel_when_forced(triton_backend):
    x, out = torch.randn(3, 32), torch.zeros(3, 16)
    a, b = torch.randn(2, 8, 32), torch.randn(2, 16, 8)
    starts, slots, longest = _segments([1, 1, 0])
    got = ops.lora_shrink_expand(x, out.clone(), a, b, starts, slots, longest)
    torch.testing.assert_close(got, per_token_delta(x, out, a, b, [1, 1, 0]), atol=1e-5, rtol=1e-5)
