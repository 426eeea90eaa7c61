"""N-gram (prompt lookup) proposer: the tokens that followed the last n tokens the last time
they occurred in this sequence's prompt and output (vLLM's `method: ngram`).

Each sequence keeps a hash index from every n-gram (n in [prompt_lookup_min, prompt_lookup_max])
to the position after its latest occurrence, extended by the tokens appended since the last
call, so a step costs O(new tokens x n range) whatever the context length, not a scan of it.
The longest n that matches wins; among occurrences of it the latest (a repeated passage is
most likely to go on as it did the last time).
"""

from __future__ import annotations

from ..sequence import Sequence


class NgramIndex:
    """n-gram -> the position right after its latest occurrence, for one token list."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.after: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0   # n-grams ending before this position are in `after`

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token (each has a continuation)."""
        after, n_min, n_max = self.after, self.n_min, self.n_max
        for end in range(max(self.num_indexed, n_min), len(tokens)):
            for n in range(n_min, min(n_max, end) + 1):
                after[tuple(tokens[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: list[int], max_tokens: int) -> list[int]:
        """The continuation of the longest indexed n-gram that ends `tokens` ([] if none). A
        continuation that runs into the end of `tokens` goes on with its own drafts (a loop of
        period len(tokens) - end repeats), so a recent match still gives `max_tokens` drafts."""
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self.after.get(tuple(tokens[-n:]))
            if end is not None:
                drafts = tokens[end:end + max_tokens]
                period = len(tokens) - end
                while len(drafts) < max_tokens:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.n_min, self.n_max = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[int, NgramIndex] = {}   # id(seq) -> its index, until `release`

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        index = self._indexes.get(id(seq))
        if index is None:
            index = self._indexes[id(seq)] = NgramIndex(self.n_min, self.n_max)
        index.extend(seq.token_ids)
        return index.lookup(seq.token_ids, min(self.k, max_tokens))

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(id(seq), None)
