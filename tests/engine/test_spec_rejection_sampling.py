"""Rejection sampling keeps the target distribution: drafts drawn from a different distribution q,
verified by the sampler against the model's p, yield tokens distributed as p.

Chi-square goodness of fit at significance level alpha = 0.001 on a 6-token vocabulary, with a
fixed seed and a bounded number of samples (20,000 rows in one sampler call). The same test
rejects the drafts themselves (distributed as q), so it has the power to see a wrong rule.
"""

from __future__ import annotations

import pytest
import torch

from kubeinfer.server.engine.sampler import Sampler
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Request

pytestmark = pytest.mark.unit

ALPHA = 0.001
NUM_SAMPLES = 20_000
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -3.0])


def _p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square goodness of fit over the cells with a positive expectation (a sample in a cell
    expected empty fails outright)."""
    if counts[expected_probs == 0].sum() > 0:
        return 0.0
    keep = expected_probs > 0
    expected = expected_probs[keep] * counts.sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params, q", [
    # q differs everywhere: drafts of token 0 are too rare, of token 5 far too common
    (SamplingParams(temperature=0.9), torch.tensor([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])),
    # top_k=3 leaves p zero on tokens 3-5, which q proposes often; q is zero on token 2
    (SamplingParams(temperature=1.3, top_k=3), torch.tensor([0.3, 0.1, 0.0, 0.2, 0.2, 0.2])),
    # q = p: every draft is kept
    (SamplingParams(temperature=1.0), LOGITS.softmax(-1)),
])
def test_verified_drafts_are_distributed_as_the_target(params, q):
    generator = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q, NUM_SAMPLES, replacement=True, generator=generator).tolist()
    rows = []
    for draft in drafts:
        seq = Request("r", [1, 2, 3], params, frozenset(), 64).seqs[0]
        seq.draft_token_ids, seq.draft_probs = [draft], q[None]
        rows.append(seq)
    sampler = Sampler(seed=99, device=torch.device("cpu"))
    tokens = torch.tensor(sampler(LOGITS.expand(NUM_SAMPLES, -1).clone(), rows).token_ids)
    target = sampler.distribution(LOGITS[None], rows[:1])[0]
    target = target / target.sum()
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    assert _p_value(counts, target.double()) > ALPHA
    # the drafts alone are q-distributed: the same test rejects them (unless q is p)
    draft_counts = torch.bincount(torch.tensor(drafts), minlength=len(LOGITS)).double()
    if not torch.allclose(q, target, atol=1e-6):
        assert _p_value(draft_counts, target.double()) < ALPHA
    # kept drafts: P(keep) = sum_x min(p(x), q(x)), within 5 standard deviations
    kept = float((tokens == torch.tensor(drafts)).double().mean())
    want = float(torch.minimum(target, q / q.sum()).sum())
    assert abs(kept - want) < 5 * (want * (1 - want) / NUM_SAMPLES) ** 0.5 + 1e-9


def test_a_row_without_draft_probabilities_samples_as_before():
    """Deterministic drafts (n-gram, suffix) set no q: the row is sampled from p as usual and
    the engine keeps the draft only when the sample equals it."""
    params = SamplingParams(temperature=1.0, seed=5)
    seq = Request("r", [1, 2, 3], params, frozenset(), 64).seqs[0]
    plain = Sampler(seed=0, device=torch.device("cpu"))(LOGITS[None].clone(), [seq]).token_ids
    seq = Request("r", [1, 2, 3], params, frozenset(), 64).seqs[0]
    seq.draft_token_ids = [5]
    assert Sampler(seed=0, device=torch.device("cpu"))(LOGITS[None].clone(), [seq]).token_ids == plain
