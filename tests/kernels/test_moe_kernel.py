"""The MoE grouped GEMM (Triton, under the interpreter) and the grouped torch path against a plain
per-token loop over each token's chosen experts."""

import pytest
import torch
from torch.nn import functional as F

from kubeinfer.kernels.reference.moe_ref import fused_moe_ref
from kubeinfer.kernels.triton.moe import align_by_expert, fused_moe

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-5, torch.float16: 3e-3}


def _problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0,
             only_expert: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=generator) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=generator)
    if only_expert is not None:   # every token's first choice is one expert
        logits[:, only_expert] += 100
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def _per_token(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t].float(), w13[e].float()).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[e].float())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, only_expert", [
    pytest.param(1, 8, 2, 64, 48, None, id="decode-one-token"),
    pytest.param(7, 8, 2, 64, 48, None, id="few-tokens-some-experts-idle"),
    pytest.param(37, 4, 2, 96, 80, None, id="ragged-widths"),
    pytest.param(80, 8, 2, 64, 32, 3, id="block-m-64-one-hot-expert"),
])
def test_triton_and_grouped_torch_match_per_token_loop(tokens, experts, top_k, hidden, inter, only_expert, dtype):
    x, w13, w2, weights, ids = _problem(tokens, experts, top_k, hidden, inter, dtype, only_expert=only_expert)
    expected = _per_token(x, w13, w2, weights, ids)
    tol = TOLERANCES[dtype]
    for got in (fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids)):
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_align_pads_each_expert_run_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    slots, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    sentinel = ids.numel()
    # expert 0: slots 1, 4; expert 2: slots 0, 2, 5; expert 3: slot 3; expert 1 has no block
    assert slots[:12].tolist() == [1, 4, sentinel, sentinel, 0, 2, 5, sentinel, 3, sentinel, sentinel, sentinel]
    assert block_experts[:3].tolist() == [0, 2, 3] and (block_experts[3:] == 4).all()
    assert (slots[12:] == sentinel).all()
