"""The speculative-decoding seam: a proposer guesses the tokens that follow a sequence.

Before each step the engine asks the proposer (when it has one) for draft tokens of every
running decode. The scheduler gives such a sequence 1 + k query positions, the model scores
all of them in the one forward pass, and the sampler samples each position; the engine keeps
the drafts up to the first one the sampled token disagrees with, plus that sampled token
(0..k drafts accepted, always one new token), and the KV-cache manager gives back the blocks
of the rejected tail. Sampling each position from the model and accepting only equal drafts
leaves the output distribution the model's own (greedy output is unchanged); a proposer that
samples its drafts from a distribution q sets `Sequence.draft_probs`, and the sampler then
accepts each draft with probability min(1, p/q) instead (rejection sampling, `sampler.py`).

The engine calls a proposer through `spec_decode.speculator.Speculator`, which decides who
drafts (length limits, logits processors, batch size, acceptance so far). Optional methods:
`propose_batch(seqs, max_tokens) -> [drafts]` to draft for all sequences at once (a draft
model's batched forward pass), and `release(seq)` when a sequence is finished, aborted or failed.
Proposers: `spec_decode/ngram.py`, `spec_decode/suffix.py`, `spec_decode/draft_model.py`.
"""

from __future__ import annotations

from typing import Protocol

from .sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most `max_tokens` draft tokens to follow `seq.token_ids` ([] for none)."""
        ...
