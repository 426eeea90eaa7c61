"""Sampler: batch-wide greedy/random sampling, penalties, masks, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kubeinfer.kernels.cpu import fused_cpu
from kubeinfer.server.engine.sampler import Sampler, _inverse_transform
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Request, Sequence

pytestmark = pytest.mark.unit

EOS = 3


def _seqs(*params: SamplingParams, prompt: list[int] | None = None) -> list[Sequence]:
    return [Request(str(i), prompt or [0, 1], p, frozenset({EOS}), 1024).seqs[0]
            for i, p in enumerate(params)]


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(0, torch.device("cpu"))(logits, _seqs(*[SamplingParams(temperature=0)] * 5))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_samples_from_the_softmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]]))
    rows = 4000
    params = [SamplingParams(temperature=1.0)] * rows + [SamplingParams(temperature=0)]
    out = Sampler(1, torch.device("cpu"))(logits.expand(rows + 1, 4), _seqs(*params))
    counts = torch.bincount(torch.tensor(out.token_ids[:rows]), minlength=4).float() / rows
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)
    assert out.token_ids[-1] == 0


def test_top_k_top_p_min_p_restrict_the_choice():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(3000, 4)
    sampler = Sampler(2, torch.device("cpu"))
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}),
                            (SamplingParams(top_p=0.6), {0, 1}),
                            (SamplingParams(top_p=0.3), {0}),
                            (SamplingParams(min_p=0.6), {0, 1})]:
        out = sampler(logits, _seqs(*[params] * 3000))
        assert set(out.token_ids) == allowed, params


def test_seeded_requests_replay_whatever_the_batch():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=42)

    def draws(batch_noise: int) -> list[int]:
        sampler = Sampler(batch_noise, torch.device("cpu"))
        seq = _seqs(seeded)[0]
        others = _seqs(*[SamplingParams(temperature=1.0)] * batch_noise)
        tokens = []
        for _ in range(20):
            batch = others + [seq]
            out = sampler(logits.expand(len(batch), 100), batch)
            tokens.append(out.token_ids[-1])
            seq.token_ids.append(out.token_ids[-1])   # as the engine does: the next draw is the next position's
        return tokens

    assert draws(0) == draws(7) and len(set(draws(0))) > 1


def test_a_rows_token_does_not_depend_on_how_its_neighbours_sample():
    """Temperature-only rows take the fused CPU kernel, top-p/top-k/min-p rows torch: with the
    same draws, every row gets the token it gets alone, whichever mix of ways the batch holds."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(9)) * 3
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_p=0.9, seed=2),
              SamplingParams(temperature=0, seed=3), SamplingParams(temperature=1.0, min_p=0.05, seed=4)]
    batch = Sampler(0, torch.device("cpu"))(logits, _seqs(*params))
    alone = [Sampler(0, torch.device("cpu"))(logits[i:i + 1], _seqs(p)).token_ids[0] for i, p in enumerate(params)]
    assert not batch.errors and batch.token_ids == alone


def test_temperature_only_rows_take_the_kernel_and_draw_what_torch_draws(monkeypatch):
    """The rows with only a temperature (and only those) go to the fused kernel, each with its
    own temperature and draw: the batch's tokens equal those of the same batch sampled by torch
    alone."""
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3)) * 3
    if not fused_cpu.sample_rows_available(logits):
        pytest.skip("the fused CPU kernels are not built here")
    params = [SamplingParams(temperature=0.6, seed=1), SamplingParams(temperature=1.0, top_k=20, seed=2),
              SamplingParams(temperature=1.4, seed=3), SamplingParams(temperature=0, seed=4),
              SamplingParams(temperature=0.9, top_p=0.8, seed=5), SamplingParams(temperature=2.0, seed=6)]
    kernel_rows, sample_rows = [], fused_cpu.sample_rows
    monkeypatch.setattr(fused_cpu, "sample_rows",
                        lambda logits, rows, *args: kernel_rows.append(list(rows)) or sample_rows(logits, rows, *args))
    with_kernel = Sampler(0, torch.device("cpu"))(logits, _seqs(*params)).token_ids
    monkeypatch.setattr(fused_cpu, "sample_rows_available", lambda logits: False)
    torch_only = Sampler(0, torch.device("cpu"))(logits, _seqs(*params)).token_ids
    assert kernel_rows == [[0, 2, 5]] and with_kernel == torch_only


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(2, 8)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    out = Sampler(0, torch.device("cpu"))(logits, _seqs(params, SamplingParams(temperature=0)))
    assert out.token_ids[0] not in (EOS, 5) and out.token_ids[1] == EOS


def test_penalties_push_repeated_tokens_down():
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0]])
    sampler = Sampler(0, torch.device("cpu"))
    rep = _seqs(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0, 2])
    assert sampler(logits, rep).token_ids == [1]  # 2.0/1.2 < 1.9; 1.8/1.2 too
    freq = _seqs(SamplingParams(temperature=0, frequency_penalty=0.1), prompt=[0])
    freq[0].token_ids += [0, 0]  # generated token 0 twice: 2.0 - 0.2 < 1.9
    assert sampler(logits, freq).token_ids == [1]
    pres = _seqs(SamplingParams(temperature=0, presence_penalty=0.05), prompt=[5, 1, 1])
    pres[0].token_ids += [0]  # only output tokens count: 2.0 - 0.05 > 1.9
    assert sampler(logits, pres).token_ids == [0]


def test_logprobs_are_raw_log_softmax_with_the_sampled_token():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.5, logprobs=3, seed=1), SamplingParams(temperature=0)]
    out = Sampler(0, torch.device("cpu"))(logits, _seqs(*params))
    ids, values, sampled_lp, rank = out.logprobs[0]
    reference = logits[0].log_softmax(-1)
    assert ids == reference.topk(3).indices.tolist()
    assert all(math.isclose(v, r, abs_tol=1e-5) for v, r in zip(values, reference.topk(3).values))
    token = out.token_ids[0]
    assert math.isclose(sampled_lp, float(reference[token]), abs_tol=1e-5)
    assert rank == int((reference > reference[token]).sum()) + 1
    assert out.logprobs[1] is None


def test_inverse_transform_never_lands_on_a_zero_probability_token():
    """At both ends of the uniform range, masked tokens (probability 0) before, between and after
    the allowed ones are never chosen, and rows need not sum to 1 (min_p leaves them short)."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.0, 0.0]] * 3)
    uniform = torch.tensor([[0.0], [0.3], [1.0 - 2 ** -24]])
    assert _inverse_transform(probs, uniform).tolist() == [1, 1, 3]


def test_a_faulty_row_fails_alone_and_the_others_keep_their_tokens():
    """A NaN row samples no valid token; the rows beside it get what they get without it,
    seeded and unseeded draws included."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.5)]
    clean = Sampler(3, torch.device("cpu"))(logits, _seqs(*params))
    broken = logits.clone()
    broken[1] = float("nan")
    out = Sampler(3, torch.device("cpu"))(broken, _seqs(*params))
    assert set(out.errors) == {1} and out.token_ids[1] == -1
    assert [t for i, t in enumerate(out.token_ids) if i != 1] == \
        [t for i, t in enumerate(clean.token_ids) if i != 1]


def test_a_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6))
    seqs = _seqs(*[SamplingParams(temperature=1.0, top_p=p) for p in (1e-46, 5e-324, 1e-9)])
    out = Sampler(0, torch.device("cpu"))(logits, seqs)
    assert not out.errors and out.token_ids == logits.argmax(-1).tolist()


def test_extreme_values_are_normalised_to_ones_the_sampler_computes():
    tiny = SamplingParams(temperature=1e-40, repetition_penalty=1e-300)
    tiny.validate()
    assert tiny.temperature == 0.0 and tiny.repetition_penalty > 0.0
    low = SamplingParams(temperature=1e-3)
    low.validate()
    assert low.temperature == 0.01
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(8))
    huge = SamplingParams(temperature=0.5, repetition_penalty=1e300, top_k=10**30, seed=2**63 - 1)
    huge.validate()
    out = Sampler(0, torch.device("cpu"))(logits, _seqs(huge, tiny, prompt=[0, 1, 2]))
    assert not out.errors and all(0 <= t < 50 for t in out.token_ids)
