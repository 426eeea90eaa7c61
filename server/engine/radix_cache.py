"""Prefix cache: a radix tree over token ids at block granularity (SGLang's RadixCache).

Each edge holds a run of full blocks and is keyed by its first block's tokens. The tree owns
one reference on every block it holds; a node is evictable when it is a leaf and the tree
holds the only reference to its blocks (no running sequence reads them), so no separate lock
count can drift out of sync with the block pool. The request's `ExtraKey` (cache salt and
LoRA adapter) selects a separate tree, so tenants with different salts, and different
adapters, never share blocks. With a `KVEventLog`, every block also carries
its chain hash (`kv_events`), and blocks entering and leaving the tree are published there.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .kv_events import ExtraKey, KVEventLog

Key = tuple[int, ...]


@dataclass(eq=False)
class Node:
    tokens: list[int]  # len == len(blocks) * block_size
    blocks: list[int]
    parent: "Node | None"
    children: dict[Key, "Node"] = field(default_factory=dict)
    last_access: float = field(default_factory=time.monotonic)
    hashes: list[int] = field(default_factory=list)  # per block, with a KVEventLog only


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int, events: KVEventLog | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.events = events
        self.roots: dict[ExtraKey, Node] = {}
        self.num_cached_blocks = 0
        self._tick = itertools.count()

    def _root(self, key: ExtraKey) -> Node:
        if key not in self.roots:
            self.roots[key] = Node([], [], None)
        return self.roots[key]

    def _walk(self, tokens: list[int], key: ExtraKey) -> tuple[Node, int, list[int]]:
        """Follow full blocks of `tokens`: (deepest node, blocks matched on its edge, blocks)."""
        bs, node, matched = self.block_size, self._root(key), []
        now, pos = time.monotonic(), 0
        while pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            child.last_access = now
            count = 1
            while (count < len(child.blocks) and pos + (count + 1) * bs <= len(tokens)
                   and child.tokens[count * bs:(count + 1) * bs]
                   == tokens[pos + count * bs:pos + (count + 1) * bs]):
                count += 1
            matched += child.blocks[:count]
            pos += count * bs
            if count < len(child.blocks):
                return child, count, matched
            node = child
        return node, len(node.blocks), matched

    def match_prefix(self, tokens: list[int], key: ExtraKey = ExtraKey()) -> list[int]:
        """Blocks of the longest cached full-block prefix of `tokens` (no references taken)."""
        return self._walk(tokens, key)[2]

    def insert(self, tokens: list[int], blocks: list[int], key: ExtraKey = ExtraKey()) -> list[int]:
        """Cache `blocks` holding the KV of `tokens` (full blocks only); returns the tree's blocks.

        Where the tree already holds a prefix, its blocks win and are returned, so the caller
        can switch to them and free its duplicates.
        """
        num_full = min(len(tokens) // self.block_size, len(blocks))
        tokens = tokens[:num_full * self.block_size]
        node, count, matched = self._walk(tokens, key)
        if count < len(node.blocks):
            node = self._split(node, count)
        rest = blocks[len(matched):num_full]
        if rest:
            start = len(matched) * self.block_size
            child = Node(tokens[start:], list(rest), node)
            node.children[tuple(child.tokens[:self.block_size])] = child
            if self.events is not None:
                hasher = self.events.hasher
                parent = node.hashes[-1] if node.parent is not None else None
                child.hashes = hasher.chain(hasher.root(*key) if parent is None else parent,
                                            child.tokens, self.block_size)
                self.events.stored(child.hashes, parent, child.tokens, key)
            for block in rest:
                self.pool.cache_incref(block)
            self.num_cached_blocks += len(rest)
        return matched + list(rest)

    def _split(self, node: Node, count: int) -> Node:
        """Cut `node`'s edge after `count` blocks; returns the new upper node."""
        assert node.parent is not None and 0 < count < len(node.blocks)
        cut = count * self.block_size
        upper = Node(node.tokens[:cut], node.blocks[:count], node.parent, {},
                     node.last_access, node.hashes[:count])
        node.hashes = node.hashes[count:]
        node.parent.children[tuple(node.tokens[:self.block_size])] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[count:], upper
        upper.children[tuple(node.tokens[:self.block_size])] = node
        return upper

    def _evictable(self, node: Node) -> bool:
        return (node.parent is not None and not node.children
                and all(self.pool.ref_counts[b] == 1 for b in node.blocks))

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks from unreferenced leaves, least recently used
        first (fewer if not enough are evictable); returns how many were freed."""
        heap = [(n.last_access, next(self._tick), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.tokens[:self.block_size])]
            for block in node.blocks:
                self.pool.cache_decref(block)
            if self.events is not None:
                self.events.removed(node.hashes)
            freed += len(node.blocks)
            self.num_cached_blocks -= len(node.blocks)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return freed

    def _nodes(self) -> list[Node]:
        stack, nodes = list(self.roots.values()), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def cached_blocks(self) -> list[int]:
        return [block for node in self._nodes() for block in node.blocks]

    def drop_adapter(self, adapter: str) -> int:
        """Forget every block cached under LoRA adapter `adapter` (in any cache_salt); returns how
        many. The namespace is the adapter's name, so a different adapter loaded again under the
        same name must not find the old one's K/V."""
        dropped = 0
        for key in [key for key in self.roots if key.adapter == adapter]:
            stack = list(self.roots.pop(key).children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                for block in node.blocks:
                    self.pool.cache_decref(block)
                if self.events is not None:
                    self.events.removed(node.hashes)
                dropped += len(node.blocks)
        self.num_cached_blocks -= dropped
        return dropped

    def clear(self) -> None:
        """Drop every cached block (the tree's references only)."""
        for node in self._nodes():
            for block in node.blocks:
                self.pool.cache_decref(block)
        self.roots.clear()
        self.num_cached_blocks = 0
        if self.events is not None:
            self.events.cleared()
