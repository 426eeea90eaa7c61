"""The proposers' own logic, without a model: what each drafts for a given token history."""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace

import pytest

from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Request, Sequence
from kubeinfer.server.engine.spec_decode.config import SpeculativeConfig
from kubeinfer.server.engine.spec_decode.ngram import NgramIndex
from kubeinfer.server.engine.spec_decode.suffix import SuffixProposer, SuffixTrie

pytestmark = pytest.mark.unit


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


def _substring_counts(token_lists: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for tokens in token_lists:
        for start in range(len(tokens)):
            for end in range(start + 1, min(start + depth, len(tokens)) + 1):
                key = tuple(tokens[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def _trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    counts, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def test_suffix_trie_counts_every_substring_and_forgets_removed_lists():
    rng = random.Random(1)
    for _ in range(30):
        depth = rng.randint(2, 6)
        lists = [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 6))]
        trie = SuffixTrie(depth)
        for tokens in lists:
            trie.add(tokens)
        assert _trie_counts(trie) == _substring_counts(lists, depth)
        removed = rng.sample(range(len(lists)), rng.randint(0, len(lists)))
        for i in removed:
            trie.remove(lists[i])
        kept = [tokens for i, tokens in enumerate(lists) if i not in removed]
        assert _trie_counts(trie) == _substring_counts(kept, depth)   # nothing left with a zero count


def _seq(tokens: list[int], num_prompt_tokens: int | None = None) -> Sequence:
    seq = Request("r", tokens[:num_prompt_tokens], SamplingParams(), frozenset(), 4096).seqs[0]
    seq.token_ids = list(tokens)
    return seq


def _suffix(**overrides) -> SuffixProposer:
    values = dict(method="suffix", num_speculative_tokens=4, suffix_decoding_max_spec_factor=4.0)
    return SuffixProposer(SpeculativeConfig(**{**values, **overrides}))


def test_suffix_proposes_the_most_frequent_continuation_of_earlier_responses():
    proposer = _suffix()
    for response in ([7, 8, 9, 10, 11], [7, 8, 9, 10, 11], [7, 8, 9, 20, 21]):   # 9 -> 10 twice, 9 -> 20 once
        proposer.release(_seq([1, 2] + response, num_prompt_tokens=2))
    assert proposer.propose(_seq([50, 51, 7, 8, 9]), 4) == [10, 11]
    # the request's own text counts as well, and its longer match wins: 3 8 9 -> 30 31
    assert proposer.propose(_seq([3, 8, 9, 30, 31, 40, 3, 8, 9]), 4) == [30, 31, 40, 3]
    # a continuation whose share falls under min_token_prob is cut: 9 -> 10 is 2/3, then 11 is 2/2
    strict = _suffix(suffix_decoding_min_token_prob=0.7)
    for response in ([7, 8, 9, 10, 11], [7, 8, 9, 10, 11], [7, 8, 9, 20, 21]):
        strict.release(_seq([1, 2] + response, num_prompt_tokens=2))
    assert strict.propose(_seq([50, 51, 7, 8, 9]), 4) == []
    assert strict.propose(_seq([50, 51, 7, 8, 9, 10]), 4) == [11]


def test_suffix_drafts_are_bounded_by_the_match_length_and_the_request():
    proposer = _suffix(suffix_decoding_max_spec_factor=1.0)
    proposer.release(_seq([1, 2, 3, 4, 5, 6, 7, 8], num_prompt_tokens=0))
    assert proposer.propose(_seq([9, 2]), 4) == [3]            # a 1-token match drafts 1 token
    assert proposer.propose(_seq([9, 1, 2]), 4) == [3, 4]      # 2 tokens: 2
    assert proposer.propose(_seq([1, 2, 3, 4, 5]), 2) == [6, 7]   # and never more than asked


def test_suffix_cache_keeps_the_latest_responses_within_its_bounds():
    proposer = _suffix(suffix_decoding_max_cached_requests=2, suffix_decoding_max_cached_tokens=12)
    for first in (100, 200, 300):
        proposer.release(_seq([first, first + 1, first + 2, first + 3], num_prompt_tokens=0))
    assert len(proposer.cached) == 2 and proposer.num_cached_tokens == 8
    assert proposer.propose(_seq([100, 101]), 2) == []         # the oldest response is gone
    assert proposer.propose(_seq([200, 201]), 2) == [202, 203]
    long = list(range(400, 410))
    proposer.release(_seq(long, num_prompt_tokens=0))   # 10 tokens: only 12 fit, both others go
    assert list(proposer.cached.values()) == [long] and proposer.num_cached_tokens == 10
    assert _trie_counts(proposer.shared) == _substring_counts([long], 24)
    proposer.release(_seq(list(range(500, 513)), num_prompt_tokens=0))   # longer than the bound: not cached
    assert list(proposer.cached.values()) == [long]


def test_suffix_matches_follow_a_sequence_as_it_grows():
    """The cursor into the shared trie is extended token by token, and rebuilt after the shared
    trie changed; either way it finds what a fresh proposer finds."""
    rng = random.Random(3)
    proposer = _suffix()
    responses = [[rng.randrange(6) for _ in range(20)] for _ in range(4)]
    tokens = [rng.randrange(6) for _ in range(5)]
    seq = _seq(tokens)
    for step in range(40):
        if step % 10 == 5:
            proposer.release(_seq(responses[step // 10], num_prompt_tokens=0))
        fresh = _suffix()
        for response in responses[:(step + 5) // 10]:
            fresh.release(_seq(response, num_prompt_tokens=0))
        assert proposer.propose(seq, 4) == fresh.propose(_seq(list(seq.token_ids)), 4)
        seq.token_ids += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_suffix_request_trie_holds_only_the_substrings_of_its_last_window():
    """A sequence's own trie counts exactly the substrings of its last
    `suffix_decoding_max_request_tokens` tokens, however it grows (a token at a time, in bursts,
    or by more than the window at once), and drafts what a fresh proposer finds on that window."""
    rng = random.Random(5)
    for trial in range(20):
        depth, window = rng.randint(2, 5), rng.randint(5, 20)
        proposer = _suffix(suffix_decoding_max_tree_depth=depth, suffix_decoding_max_request_tokens=window)
        seq = _seq([rng.randrange(4) for _ in range(rng.randint(1, 3 * window))])
        for step in range(60):
            drafts = proposer.propose(seq, 3)
            state = proposer._states[id(seq)]
            tail = seq.token_ids[-window:]
            assert _trie_counts(state.own) == _substring_counts([tail], depth), (trial, step)
            assert state.own.num_nodes == len(_trie_counts(state.own)) <= window * depth
            fresh = _suffix(suffix_decoding_max_tree_depth=depth, suffix_decoding_max_request_tokens=window)
            assert drafts == fresh.propose(_seq(tail), 3)
            grow = rng.choice((1, 1, 2, rng.randint(1, 2 * window)))
            seq.token_ids += [rng.randrange(4) for _ in range(grow)]


def test_suffix_request_memory_stays_within_its_bound_on_a_long_generation():
    """6,000 generated tokens with no repeats (the most nodes a token can make): the trie never
    holds more than window x depth nodes, and the memory the proposer holds at the end (traced
    to suffix.py) is what it held when the window first filled: nothing grows with the output."""
    import tracemalloc

    from kubeinfer.server.engine.spec_decode import suffix

    def held() -> int:
        only = [tracemalloc.Filter(True, suffix.__file__)]
        return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(only).statistics("filename"))

    depth, window = 24, 128
    proposer = _suffix(suffix_decoding_max_tree_depth=depth, suffix_decoding_max_request_tokens=window)
    seq = _seq(list(range(100_000, 100_064)))
    tracemalloc.start()
    try:
        peak_nodes, filled = 0, 0
        for token in range(6_000):
            seq.token_ids.append(token)
            proposer.propose(seq, 4)
            peak_nodes = max(peak_nodes, proposer._states[id(seq)].own.num_nodes)
            if seq.num_tokens == window + depth:
                filled = held()
        end = held()
    finally:
        tracemalloc.stop()
    # distinct tokens: every substring starting in the window is a node (the last few are shorter)
    assert peak_nodes == window * depth - depth * (depth - 1) // 2
    assert 0 < end <= filled * 1.05, (filled, end)
    assert proposer._states[id(seq)].first == seq.num_tokens - window


def test_suffix_request_window_must_hold_the_tree_depth():
    with pytest.raises(ValueError, match="suffix_decoding_max_request_tokens must be >= "):
        SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_max_tree_depth=24,
                          suffix_decoding_max_request_tokens=16)


def _allowed_tokens(processor, vocab_size: int) -> list[int]:
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    processor.live_matcher().fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [i for i, bit in enumerate(bits.flatten()[:vocab_size].tolist()) if bit]


def test_a_grammar_checks_drafts_masks_each_draft_position_and_rolls_back():
    """The grammar side of drafting, on a toy vocabulary: `validate_drafts` gives the prefix the
    grammar allows (a stop token ends it), a draft position's view masks as the grammar stands
    after the drafts in front of it, the sequence's own state never moves, and after
    verification the kept drafts and the sampled token leave the matcher where plain decoding
    would."""
    import xgrammar as xgr

    from kubeinfer.server.engine.structured_output import GrammarBackend, GrammarProcessor, GrammarViolation

    a, b, c, eos, x = range(5)
    vocab = ["a", "b", "c", "</s>", "x"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=5, stop_token_ids=[eos])
    grammar = xgr.GrammarCompiler(info).compile_grammar('root ::= ("a" | "b")* "c"')
    backend = SimpleNamespace(_xgr=xgr, vocab_size=5)   # what a processor reads of its GrammarBackend
    backend.allows_some_token = partial(GrammarBackend.allows_some_token, backend)
    processor = GrammarProcessor(backend, xgr.GrammarMatcher(grammar), is_json=False)   # type: ignore[arg-type]
    assert processor.validate_drafts([a, b, a, c, eos, a]) == 5   # nothing follows the stop token
    assert processor.validate_drafts([a, x, b]) == 1
    assert processor.validate_drafts([]) == 0
    assert _allowed_tokens(processor.at_drafts([a, c]), 5) == [eos]
    assert _allowed_tokens(processor.at_drafts([a, x, b]), 5) == [a, b, c]   # behind a refused draft: some valid mask
    assert _allowed_tokens(processor.at_drafts([a, b, c, eos]), 5) == [eos]  # behind a stop: the one before it
    assert _allowed_tokens(processor, 5) == [a, b, c]   # the sequence's own row: nothing taken yet
    # a step that drafted a b a: two drafts kept, then c sampled instead of the third
    processor.validate_drafts([a, b, a])
    for token in (a, b, c):
        processor.accept(token)
    assert _allowed_tokens(processor, 5) == [eos]
    processor.accept(eos)
    assert processor.live_matcher().is_terminated()
    # a draft refused by the grammar is never what the engine accepts: a wrong token still raises
    fresh = GrammarProcessor(backend, xgr.GrammarMatcher(grammar), is_json=False)   # type: ignore[arg-type]
    fresh.validate_drafts([a, b])
    with pytest.raises(GrammarViolation):
        fresh.accept(x)
    fresh.release()
    with pytest.raises(GrammarViolation):
        fresh.validate_drafts([a])
