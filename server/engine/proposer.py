"""The speculative-decoding seam: a proposer guesses the tokens that follow a sequence.

Before each step the engine asks the proposer (when it has one) for draft tokens of every
running decode. The scheduler gives such a sequence 1 + k query positions, the model scores
all of them in the one forward pass, and the sampler samples each position; the engine keeps
the drafts up to the first one the sampled token disagrees with, plus that sampled token
(0..k drafts accepted, always one new token), and the KV-cache manager gives back the blocks
of the rejected tail. Sampling each position from the model and accepting only equal drafts
leaves the output distribution the model's own (greedy output is unchanged).
"""

from __future__ import annotations

from typing import Protocol

from .sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most `max_tokens` draft tokens to follow `seq.token_ids` ([] for none)."""
        ...
