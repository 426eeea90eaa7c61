"""The proposers' own logic, without a model: what each drafts for a given token history."""

from __future__ import annotations

import random

from kubeinfer.server.engine.spec_decode.ngram import NgramIndex


def _brute_force_ngram(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The reference: scan the whole history for the latest earlier occurrence of the longest
    suffix n-gram, then continue it (through its own drafts once it runs past the end)."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[end + i])
                return extended[len(tokens):]
    return []


def test_ngram_index_extended_step_by_step_drafts_what_a_full_scan_finds():
    rng = random.Random(0)
    for trial in range(200):
        vocab, n_min = rng.randint(2, 6), rng.randint(1, 3)
        n_max = n_min + rng.randint(0, 3)
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        while len(tokens) < 60:
            index.extend(tokens)
            k = rng.randint(1, 6)
            assert index.lookup(tokens, k) == _brute_force_ngram(tokens, n_min, n_max, k), (trial, tokens)
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]


def test_ngram_prefers_the_longest_match_then_the_latest_occurrence():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 1, 2, 9, 7, 2, 8, 1, 2, 6, 1, 2]
    index.extend(tokens)
    # "1 2" occurred at 1-2 (then 9), at 7-8 (then 6): the latest wins; "6 1 2" never occurred before
    assert index.lookup(tokens, 2) == [6, 1]
    tokens += [9]
    index.extend(tokens)
    # "1 2 9" occurred once (then 7 2 8): longer than the "2 9" / "9" matches, same place
    assert index.lookup(tokens, 3) == [7, 2, 8]
    assert index.lookup([3, 4], 3) == []
