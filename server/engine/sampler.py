"""Turn a batch of logits into next tokens, all rows at once.

Penalties, min_tokens masking, temperature, top-k, top-p and min-p are tensor ops over the
whole batch. Randomness is inverse-transform sampling: one uniform number per row, found among
the row's cumulative probabilities by binary search. (The exponential race, argmax of probs /
Exp(1) noise, draws one number per vocabulary entry: on CPU as long as the forward pass;
kernels/README.md has the figures.) Unseeded rows draw from one engine generator
in a single call, seeded rows from their own `torch.Generator` so a request replays exactly.
Logprobs are computed from the raw model logits, before any processing, as vLLM does by
default: they describe the model, not the sampling knobs.

A row is a sequence, or in a speculative step one of its draft positions (`DraftPosition`:
the sequence plus the drafts before that position), so penalties and min_tokens see the
tokens in front of that very position, and logits processors stand after those drafts. The
engine, not the sampler, decides how many of a sequence's rows it keeps.

A fault in one row must not fail the batch: the random numbers are drawn first, so when the
batched pass raises (or yields a token outside the vocabulary) each row is sampled again on
its own with the same draws, the other rows get exactly the tokens the batch would have given,
and the faulty rows are reported in `SamplerOutput.errors`. The batched pass is the only cost
when nothing fails.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from kubeinfer.kernels import ops_cpu

from .argmax import argmax_rows
from .logits_processor import apply_logits_processors
from .outputs import Logprob
from .sequence import DraftPosition, SamplingRow, Sequence

log = logging.getLogger(__name__)


class InvalidTokenError(RuntimeError):
    """Sampling produced a token outside the vocabulary (e.g. from NaN probabilities)."""


@dataclass
class SamplerOutput:
    token_ids: list[int]  # -1 in a row that failed
    # per row: None, or (top token ids, their logprobs, sampled logprob, sampled rank)
    logprobs: list[tuple[list[int], list[float], float, int] | None]
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> why it has no token


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seeded: dict[int, _SeededStream] = {}  # id(seq) -> its generator's draws

    def forget(self, seq: Sequence) -> None:
        self.seeded.pop(id(seq), None)

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SamplerOutput:
        greedy = [seq.params.temperature == 0.0 for seq in seqs]
        uniform, errors = self._draw(seqs, greedy)
        if not errors:
            try:
                return self._sample_batch(logits, seqs, greedy, uniform)
            except Exception:  # noqa: BLE001 - isolated row by row below
                log.warning("batched sampling failed; sampling row by row", exc_info=True)
        out = SamplerOutput([], [], errors)
        for row in range(len(seqs)):
            if row not in errors:
                try:
                    one = self._sample_batch(logits[row:row + 1], seqs[row:row + 1], greedy[row:row + 1],
                                             None if uniform is None else uniform[row:row + 1])
                except Exception as error:  # noqa: BLE001 - this row's request fails alone
                    errors[row] = error
                else:
                    out.token_ids += one.token_ids
                    out.logprobs += one.logprobs
                    continue
            out.token_ids.append(-1)
            out.logprobs.append(None)
        return out

    def _draw(self, seqs: list[SamplingRow], greedy: list[bool]
              ) -> tuple[torch.Tensor | None, dict[int, Exception]]:
        """One uniform number per row (None when every row is greedy): unseeded rows from the
        engine generator in one call, seeded rows from their own."""
        errors: dict[int, Exception] = {}
        if all(greedy):
            return None, errors
        uniform = torch.rand(len(seqs), 1, generator=self.generator, device=self.device)
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None and not greedy[row]:
                try:
                    uniform[row] = self._seeded_uniform(seq)
                except Exception as error:  # noqa: BLE001 - this row's request fails alone
                    errors[row] = error
        return uniform, errors

    def _sample_batch(self, logits: torch.Tensor, seqs: list[SamplingRow], greedy: list[bool],
                      uniform: torch.Tensor | None) -> SamplerOutput:
        raw = logits
        logits = self._apply_penalties(logits, seqs)
        # In place when no row needs the raw logits' logprobs (masking again, as a retry of a
        # failed batch does, changes nothing): a copy of [rows, vocab] a step saved.
        in_place = logits is not raw or all(seq.params.logprobs is None for seq in seqs)
        logits = self._mask_stops_before_min_tokens(logits, seqs, in_place)
        logits = self._apply_processors(logits, raw, seqs)
        if uniform is None or all(greedy):
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample(logits, seqs, greedy, uniform)
        token_list = tokens.tolist()
        if token_list and max(token_list) >= logits.shape[1]:
            raise InvalidTokenError(f"sampled token {max(token_list)} is outside the vocabulary")
        return SamplerOutput(token_list, self._logprobs(raw, seqs, tokens))

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        rep = [s.params.repetition_penalty for s in seqs]
        pres = [s.params.presence_penalty for s in seqs]
        freq = [s.params.frequency_penalty for s in seqs]
        use_rep = any(r != 1.0 for r in rep)
        use_additive = any(p != 0.0 for p in pres) or any(f != 0.0 for f in freq)
        if not use_rep and not use_additive:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        if use_rep:  # HF/vLLM: over prompt and output tokens
            seen = self._counts([s.token_ids for s in seqs], vocab) > 0
            penalty = self._column(rep)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        if use_additive:  # OpenAI: over output tokens only
            counts = self._counts([s.output_token_ids for s in seqs], vocab)
            logits -= self._column(freq) * counts + self._column(pres) * (counts > 0)
        return logits

    def _counts(self, token_lists: list[list[int]], vocab: int) -> torch.Tensor:
        longest = max((len(t) for t in token_lists), default=0)
        padded = torch.full((len(token_lists), longest + 1), vocab, dtype=torch.int64)
        for row, tokens in enumerate(token_lists):
            padded[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        counts = torch.zeros(len(token_lists), vocab + 1, device=self.device)
        counts.scatter_add_(1, padded.to(self.device), torch.ones_like(padded, dtype=torch.float32,
                                                                       device=self.device))
        return counts[:, :vocab]

    def _apply_processors(self, logits: torch.Tensor, raw: torch.Tensor, seqs: list[SamplingRow]
                          ) -> torch.Tensor:
        """Per-row logits processors (grammars, ...), last so they have the final say; rows
        without any are not touched, and a batch without any costs one scan of `seqs`."""
        per_row = [seq.logits_processors for seq in seqs]
        if not any(per_row):
            return logits
        if logits is raw:  # logprobs describe the raw logits, and a failed batch is sampled again from them
            logits = logits.clone()
        with torch.inference_mode():  # the model's logits are inference tensors
            apply_logits_processors(logits, per_row)
        return logits

    def _mask_stops_before_min_tokens(self, logits: torch.Tensor, seqs: list[SamplingRow], in_place: bool = False
                                      ) -> torch.Tensor:
        rows, cols = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                stops = set(seq.params.stop_token_ids) | set(seq.request.eos_token_ids)
                rows += [row] * len(stops)
                cols += sorted(stops)
        if not rows:
            return logits
        if not in_place:
            logits = logits.clone()
        with torch.inference_mode():  # the model's logits are inference tensors
            logits[rows, cols] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[SamplingRow], greedy: list[bool],
                uniform: torch.Tensor) -> torch.Tensor:
        """Rows that only scale by temperature are sampled by the fused CPU kernel in one pass
        (torch's softmax, cumsum and searchsorted: kernels/README.md, `sample_rows_f32`); the others
        (top-k, top-p, min-p, a draft distribution to verify, logits off the CPU) by torch. The
        way a row goes depends on its own parameters only, so a seeded request gives the same
        tokens whatever it is batched with."""
        vocab = logits.shape[1]
        kernel = ops_cpu.sample_rows_available(logits)
        plain = [row for row, seq in enumerate(seqs) if kernel and not greedy[row] and _temperature_only(seq, vocab)]
        taken = set(plain)
        rest = [row for row in range(len(seqs)) if not greedy[row] and row not in taken]
        sampled = torch.zeros(len(seqs), dtype=torch.int64, device=self.device)
        if plain:
            sampled[plain] = ops_cpu.sample_rows(logits, plain, [seqs[row].params.temperature for row in plain],
                                                 uniform[plain])
        if rest:
            sampled = self._sample_torch(logits, seqs, uniform, rest, sampled)
        if not any(greedy):   # an argmax pass over the whole batch for no row
            return sampled
        greedy_mask = torch.tensor(greedy, device=self.device)
        return torch.where(greedy_mask, argmax_rows(logits), sampled)

    def _sample_torch(self, logits: torch.Tensor, seqs: list[SamplingRow], uniform: torch.Tensor,
                      rows: list[int], sampled: torch.Tensor) -> torch.Tensor:
        """`sampled` with `rows` drawn from their processed distributions (and drafts verified)."""
        index = None if len(rows) == len(seqs) else torch.tensor(rows, device=self.device)
        if index is not None:
            logits, uniform = logits.index_select(0, index), uniform.index_select(0, index)
            seqs = [seqs[r] for r in rows]
        probs = self._probs(logits, seqs)
        drawn = _inverse_transform(probs, uniform)
        verified = [row for row, seq in enumerate(seqs) if _draft_with_probs(seq) is not None]
        if verified:
            drawn = self._verify_drafts(probs, drawn, uniform, seqs, verified)
        return drawn if index is None else sampled.index_copy(0, index, drawn)

    def distribution(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from (penalties, min_tokens, temperature, top-k,
        top-p, min-p; rows need not sum to 1): what a draft model proposes from."""
        logits = self._apply_penalties(logits, seqs)
        return self._probs(self._mask_stops_before_min_tokens(logits, seqs), seqs)

    def _probs(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        params = [s.params for s in seqs]
        temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        # Dividing by 1 changes nothing but costs a pass over [rows, vocab].
        scaled = logits.float() if all(t == 1.0 for t in temperatures) else logits / self._column(temperatures)
        vocab = scaled.shape[1]
        top_k = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            k = torch.tensor([k if k > 0 else vocab for k in top_k], device=self.device)
            kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            top_p = self._column([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
            drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
            drop_sorted[:, 0] = False  # the most likely token stays, however small top_p is
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            floor = self._column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _verify_drafts(self, probs: torch.Tensor, sampled: torch.Tensor, uniform: torch.Tensor,
                       seqs: list[SamplingRow], rows: list[int]) -> torch.Tensor:
        """Rejection sampling for rows that verify a draft x drawn from a distribution q (a
        draft model's): keep x with probability min(1, p(x) / q(x)), else sample from
        normalize(max(0, p - q)); the token is then distributed as p exactly (Leviathan et al.,
        2023). One uniform number u serves both: x is kept when u < p(x) / q(x), and after a
        rejection (u - r) / (1 - r) is again uniform on [0, 1). A rejected row never yields x
        (p(x) < q(x) there), so the engine's keep-equal-drafts rule stays the acceptance test."""
        drafts = [_draft_with_probs(seqs[row]) for row in rows]
        index = torch.tensor(rows, device=self.device)
        token = torch.tensor([x for x, _ in drafts], device=self.device)
        q = torch.stack([q for _, q in drafts]).to(device=self.device, dtype=probs.dtype)
        p = probs.index_select(0, index)
        p = p / p.sum(dim=-1, keepdim=True)
        q = q / q.sum(dim=-1, keepdim=True)
        picked = torch.arange(len(rows), device=self.device)
        ratio = p[picked, token] / q[picked, token].clamp_min(torch.finfo(q.dtype).tiny)
        u = uniform.index_select(0, index).squeeze(1)
        accept = u < ratio
        rest = ((u - ratio) / (1 - ratio).clamp_min(torch.finfo(p.dtype).eps)).clamp(0.0, 1.0)
        residual = _inverse_transform((p - q).clamp_min(0.0), rest.unsqueeze(1))
        return sampled.index_copy(0, index, torch.where(accept, token, residual))

    def _seeded_uniform(self, row: SamplingRow) -> torch.Tensor:
        """A seeded sequence's number for the output position `row` samples: the position-th
        draw of the sequence's own generator, whatever the steps. A speculative step draws ahead
        for its draft positions and keeps the draws of the positions it did not reach for the
        next step, so a seeded request gives the same tokens with or without (deterministic)
        drafts, and replays exactly either way."""
        seq = row.seq if isinstance(row, DraftPosition) else row   # the draft rows share their sequence's
        stream = self.seeded.get(id(seq))
        if stream is None:
            assert seq.params.seed is not None
            stream = self.seeded[id(seq)] = _SeededStream(
                torch.Generator(device=self.device).manual_seed(seq.params.seed + seq.index), seq.num_output_tokens)
        return stream.draw(row.num_output_tokens, seq.num_output_tokens, self.device)

    def _logprobs(self, raw: torch.Tensor, seqs: list[SamplingRow], tokens: torch.Tensor
                  ) -> list[tuple[list[int], list[float], float, int] | None]:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[tuple[list[int], list[float], float, int] | None] = [None] * len(seqs)
        if not rows:
            return result
        index = torch.tensor(rows, device=self.device)
        entries = logprob_entries(raw.index_select(0, index), tokens.index_select(0, index),
                                  [seqs[i].params.logprobs or 0 for i in rows])
        for row, entry in zip(rows, entries):
            result[row] = entry
        return result


class _SeededStream:
    """A seeded sequence's generator and its draws not yet used, by output position."""

    def __init__(self, generator: torch.Generator, position: int) -> None:
        self.generator = generator
        self.first = position   # the output position of draws[0]
        self.draws: list[torch.Tensor] = []

    def draw(self, position: int, done: int, device: torch.device) -> torch.Tensor:
        """The draw for output `position`; those before `done` (tokens the sequence has) are dropped."""
        if done > self.first:
            del self.draws[:done - self.first]
            self.first = done
        while self.first + len(self.draws) <= position:
            self.draws.append(torch.rand(1, generator=self.generator, device=device))
        return self.draws[position - self.first]


def _draft_with_probs(row: SamplingRow) -> tuple[int, torch.Tensor] | None:
    """The draft token this row verifies and the distribution q it was drawn from, when its
    proposer gave one (`Sequence.draft_probs`); None for deterministic drafts and other rows."""
    seq, position = (row.seq, row.num_drafts) if isinstance(row, DraftPosition) else (row, 0)
    if seq.draft_probs is None or position >= len(seq.draft_token_ids):
        return None
    return seq.draft_token_ids[position], seq.draft_probs[position]


def _temperature_only(row: SamplingRow, vocab: int) -> bool:
    """Whether the row samples softmax(logits / T) as is: no top-k, top-p or min-p cut, and no
    draft distribution to verify."""
    params = row.params
    return ((params.top_k <= 0 or params.top_k >= vocab) and params.top_p >= 1.0 and params.min_p <= 0.0
            and _draft_with_probs(row) is None)


def _inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds `uniform [rows, 1]` times the
    row's total (rows need not sum to 1). Zero-probability tokens add nothing to the cumulative
    sum, so they are never the first to exceed it; the target stays below the total even when
    the product rounds up."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)


def logprob_entries(logits: torch.Tensor, chosen: torch.Tensor, wants: list[int]
                    ) -> list[tuple[list[int], list[float], float, int]]:
    """Per row of `logits` (float32 log-softmax taken here): its `wants[row]` best tokens and
    their logprobs, then the logprob and rank (1 = best) of its `chosen` token."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    k = max(wants, default=0)
    top = logprobs.topk(k, dim=-1) if k else None
    chosen_list, rank_list = chosen_lp.tolist(), ranks.tolist()
    entries = []
    for j, want in enumerate(wants):
        ids = top.indices[j, :want].tolist() if top is not None else []
        values = top.values[j, :want].tolist() if top is not None else []
        entries.append((ids, values, chosen_list[j], rank_list[j]))
    return entries


def to_logprob_dict(entry: tuple[list[int], list[float], float, int], sampled: int,
                    decode: Callable[[int], str]) -> dict[int, Logprob]:
    """One position's logprobs as vLLM returns them: the top-k plus the sampled token."""
    ids, values, sampled_lp, sampled_rank = entry
    out = {sampled: Logprob(sampled_lp, sampled_rank, decode(sampled))}
    for rank, (token, value) in enumerate(zip(ids, values), start=1):
        if token not in out:
            out[token] = Logprob(value, rank, decode(token))
    return out
