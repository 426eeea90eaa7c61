"""Suffix proposer (vLLM's `method: suffix`, the idea of Arctic Inference's suffix decoding):
drafts the most frequent continuation of the context's longest suffix seen before, in this
request's prompt and output or in earlier responses of the same engine (agent loops and code
edits repeat themselves across requests).

Both sources are suffix tries of bounded depth D (`suffix_decoding_max_tree_depth`): a node per
distinct substring of at most D tokens, with how often it occurred. Per sequence, the trie of its
own tokens and a cursor into the shared trie of earlier responses are extended by each new
token in O(D), never rebuilt. A proposal follows, from the node of the longest matching suffix
(the longer match of the two tries), the most frequent child while the product of the children's
shares stays above `suffix_decoding_min_token_prob`, for at most
`suffix_decoding_max_spec_factor` x the match length tokens (and num_speculative_tokens).
The shared trie keeps the responses of the last `suffix_decoding_max_cached_requests` finished
sequences, at most `suffix_decoding_max_cached_tokens` tokens in all; the oldest go first.
A sequence's own trie holds the substrings starting in its last
`suffix_decoding_max_request_tokens` tokens (at most that many x D nodes): as it grows, the
substrings starting at its oldest token are uncounted, and a longer prompt enters by its tail,
so neither a huge prompt nor a long generation grows the trie (or the time to build it) without
bound. Matches older than the window are what the n-gram proposer is for.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ..sequence import Sequence

if TYPE_CHECKING:
    from .config import SpeculativeConfig


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Occurrence counts of every substring of at most `depth` tokens of the token lists added."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0   # below the root

    def extend(self, open_nodes: list[_Node], token: int) -> list[_Node]:
        """Count `token` after each open suffix: `open_nodes[n]` is the node of the last n tokens
        (n < depth, [0] the root); returns the open nodes one token later."""
        extended = [self.root]
        for node in open_nodes:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            if len(extended) < self.depth:
                extended.append(child)
        return extended

    def add(self, tokens: list[int]) -> None:
        open_nodes = [self.root]
        for token in tokens:
            open_nodes = self.extend(open_nodes, token)

    def remove(self, tokens: list[int]) -> None:
        """Uncount a token list added before; substrings it alone held are deleted."""
        for start in range(len(tokens)):
            self.remove_prefixes(tokens[start:start + self.depth])

    def remove_prefixes(self, path: list[int]) -> None:
        """Uncount one occurrence of each prefix of `path` (the substrings counted from one start
        position: at most `depth` tokens, all of them added before)."""
        node = self.root
        for i, token in enumerate(path):
            child = node.children[token]
            child.count -= 1
            if child.count == 0:   # its descendants held only this occurrence too: one path
                del node.children[token]
                self.num_nodes -= len(path) - i
                return
            node = child

    def match(self, tokens: list[int], longest: int) -> list[_Node]:
        """Nodes of the suffixes of `tokens` of lengths 1.. found in the trie (at most `longest`)."""
        found = []
        for n in range(1, min(longest, len(tokens)) + 1):
            node = self.root
            for token in tokens[len(tokens) - n:]:
                node = node.children.get(token)  # type: ignore[assignment]
                if node is None:
                    return found
            found.append(node)
        return found


def _continuation(node: _Node, max_tokens: int, min_prob: float) -> list[int]:
    """The most frequent path below `node` while its probability stays >= `min_prob`."""
    drafts: list[int] = []
    prob = 1.0
    while len(drafts) < max_tokens and node.children:
        total = sum(child.count for child in node.children.values())
        # ties go to the smaller token id, so a draft never depends on the order of insertion
        token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
        prob *= child.count / total
        if prob < min_prob:
            break
        drafts.append(token)
        node = child
    return drafts


class _SequenceState:
    """One sequence's own trie (its open suffixes) and its matches in the shared trie."""

    def __init__(self, depth: int) -> None:
        self.own = SuffixTrie(depth)
        self.open_nodes = [self.own.root]
        self.shared_matches: list[_Node] = []   # [n - 1]: node of the last n tokens in the shared trie
        self.shared_version = -1
        self.first = 0        # the own trie counts the substrings starting at token_ids[first:]
        self.num_tokens = 0   # ... and ending before token_ids[num_tokens]


class SuffixProposer:
    def __init__(self, config: "SpeculativeConfig") -> None:
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_cached_tokens = config.suffix_decoding_max_cached_tokens
        self.max_request_tokens = config.suffix_decoding_max_request_tokens
        self.shared = SuffixTrie(self.depth)
        self.cached: OrderedDict[int, list[int]] = OrderedDict()   # responses in the shared trie, oldest first
        self.num_cached_tokens = 0
        self._version = 0   # bumped when the shared trie changes: cursors into it are rebuilt
        self._next_id = 0
        self._states: dict[int, _SequenceState] = {}

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        state = self._states.get(id(seq))
        if state is None:
            state = self._states[id(seq)] = _SequenceState(self.depth)
        tokens = seq.token_ids
        longest = max(1, self.depth - min(self.k, max_tokens))   # room below the match for the drafts
        self._advance(state, tokens, longest)
        best, length = None, 0
        # own trie: the open node of the last n tokens has children only if they occurred before
        for n in range(min(longest, len(state.open_nodes) - 1), 0, -1):
            if state.open_nodes[n].children:
                best, length = state.open_nodes[n], n
                break
        for n in range(len(state.shared_matches), length, -1):
            if state.shared_matches[n - 1].children:
                best, length = state.shared_matches[n - 1], n
                break
        if best is None:
            return []
        limit = min(max_tokens, self.k, max(1, int(self.max_spec_factor * length)))
        return _continuation(best, limit, self.min_token_prob)

    def _advance(self, state: _SequenceState, tokens: list[int], longest: int) -> None:
        """Extend the sequence's own trie and shared-trie matches by the tokens since last time."""
        window, depth = self.max_request_tokens, self.depth
        new = tokens[state.num_tokens:]
        if len(new) > window:   # a long prompt (or a long pause) enters by its tail
            state.own = SuffixTrie(depth)
            state.open_nodes = [state.own.root]
            state.first = state.num_tokens = len(tokens) - window
            state.shared_version = -1   # the shared-trie matches are looked up again
            new = tokens[state.num_tokens:]
        own = state.own
        for token in new:
            state.open_nodes = own.extend(state.open_nodes, token)
            state.num_tokens += 1
            if state.num_tokens - state.first > window:   # the oldest start leaves (window >= depth)
                own.remove_prefixes(tokens[state.first:state.first + depth])
                state.first += 1
        if state.shared_version != self._version:
            state.shared_matches = self.shared.match(tokens, longest)
            state.shared_version = self._version
            return
        for token in new:
            matches = [self.shared.root.children.get(token)]
            matches += [node.children.get(token) for node in state.shared_matches[:longest - 1]]
            state.shared_matches = matches[:next((i for i, node in enumerate(matches) if node is None), len(matches))]  # type: ignore[misc]

    def release(self, seq: Sequence) -> None:
        """A finished sequence's response joins the shared trie (an aborted one's too: its tokens
        are still the model's); the oldest responses leave it past the bounds."""
        self._states.pop(id(seq), None)
        response = seq.output_token_ids
        if not response or self.max_cached_requests == 0 or len(response) > self.max_cached_tokens:
            return
        self.shared.add(response)
        self.cached[self._next_id] = response
        self._next_id += 1
        self.num_cached_tokens += len(response)
        while len(self.cached) > self.max_cached_requests or self.num_cached_tokens > self.max_cached_tokens:
            _, oldest = self.cached.popitem(last=False)
            self.shared.remove(oldest)
            self.num_cached_tokens -= len(oldest)
        self._version += 1
