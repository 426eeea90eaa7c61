"""Block tables of sequences on top of the block pool and the (optional) prefix cache."""

from __future__ import annotations

import time

from .block_pool import BlockPool
from .kv_events import BlockHasher, KVEventLog, KVEventPublisher
from .radix_cache import RadixCache
from .sequence import Sequence
from .stats import DecayingSum


# What a released block's table entry reads (`_release_out_of_window`): a valid block id, so
# kernels may gather it, holding finite K/V of whoever owns it; every key there is masked out.
NULL_BLOCK = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int | None = None, event_publisher: KVEventPublisher | None = None,
                 hash_key: str | None = None) -> None:
        """`sliding_window`: every layer attends to the last `sliding_window` positions only
        (Mistral, Phi-3, an all-local Gemma): blocks no future query can see go back to the pool
        while their sequence runs. None when any layer attends to the whole context.
        `event_publisher`: also sends the prefix cache's events out (`--kv-events-config`)."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        # what routers read to send requests where their prefix is cached (GET /kv/blocks)
        self.events = (KVEventLog(block_size, publisher=event_publisher, hasher=BlockHasher(hash_key))
                       if enable_prefix_caching else None)
        self.cache = RadixCache(self.pool, block_size, self.events) if enable_prefix_caching else None
        self.prefix_cache_queries = 0  # tokens
        self.prefix_cache_hits = 0  # tokens
        self.recent_prefix_cache_hits = DecayingSum()  # tokens, halving every 10 minutes

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references (cache-only blocks count as reclaimable)."""
        return self.pool.num_used

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks only the prefix cache references: not free, but reclaimed on demand."""
        return self.pool.num_blocks - self.pool.num_free - self.pool.num_used

    def match_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest prefix; returns cached tokens.

        The last token is never matched: its logits must be computed. Nothing is matched for a
        request that still owes prompt logprobs: cached blocks hold no logits (`prompt_logprobs.py`).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.cache is None or seq.request.owes_prompt_logprobs:
            return 0
        blocks = self.cache.match_prefix(seq.token_ids[:-1], seq.request.extra_key)
        for block in blocks:
            self.pool.incref(block)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_inserted_blocks = len(blocks)
        return seq.num_computed_tokens

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count an admitted sequence's prefix lookup (in tokens), once per admission."""
        if self.cache is not None:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached_tokens
            if num_cached_tokens:
                self.recent_prefix_cache_hits = self.recent_prefix_cache_hits.add(num_cached_tokens, time.time())

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if out of blocks."""
        if self.sliding_window is not None:
            self._release_out_of_window(seq)
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        missing = needed - len(seq.block_table)
        if missing <= 0:
            return True
        if self.pool.num_free < missing and self.cache is not None:
            self.cache.evict(missing - self.pool.num_free)
        if self.pool.num_free < missing:
            return False
        seq.block_table += self.pool.allocate(missing)
        return True

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Give back the leading blocks no query from the sequence's next token on can see (a
        query at position p reads keys > p - window), keeping one block more: a fork that
        recomputes a partial last prompt block starts up to a block earlier. Their table
        entries become NULL_BLOCK (positions stay where they are). A released block the prefix
        cache holds stays cached, its K/V intact; the sequence inserts nothing more into the
        cache (its table no longer names every block of its prefix), so no cached prefix
        points at a released block."""
        count = self._window_start(seq.num_computed_tokens) // self.block_size - 1
        for i in range(seq.num_released_blocks, count):
            self.pool.decref(seq.block_table[i])
            seq.block_table[i] = NULL_BLOCK
        seq.num_released_blocks = max(seq.num_released_blocks, count)

    def _window_start(self, position: int) -> int:
        """The first key position a query at `position` reads."""
        assert self.sliding_window is not None
        return position - self.sliding_window + 1

    def cache_scheduled_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """Offer the full blocks a scheduled chunk will have computed to the prefix cache now, so
        a sequence admitted later in the same step shares them (the step stores every layer's
        K/V before attention reads any). Where the cache already holds a block, the sequence
        still computes its own copy this step; `cache_full_blocks` adopts the cached one after
        (otherwise it has nothing left to do)."""
        # draft tokens beyond the known ones are not cached: most are rejected
        num_full = min(seq.num_computed_tokens + num_new_tokens, seq.num_tokens) // self.block_size
        canonical = self._insert(seq, num_full)
        if canonical is not None and canonical[seq.num_inserted_blocks:] == seq.block_table[
                seq.num_inserted_blocks:num_full]:
            seq.num_inserted_blocks = num_full

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hand newly filled blocks to the prefix cache, adopting blocks it already holds."""
        num_full = seq.num_computed_tokens // self.block_size
        canonical = self._insert(seq, num_full)
        if canonical is None:
            return
        for i in range(seq.num_inserted_blocks, num_full):
            if seq.block_table[i] != canonical[i]:  # computed twice: keep the cached copy
                self.pool.incref(canonical[i])
                self.pool.decref(seq.block_table[i])
                seq.block_table[i] = canonical[i]
        seq.num_inserted_blocks = num_full

    def _insert(self, seq: Sequence, num_full: int) -> list[int] | None:
        """The one insert into the prefix cache: `seq`'s first `num_full` blocks; returns the
        tree's blocks for them (None: no cache, or nothing new to offer)."""
        if self.cache is None or num_full <= seq.num_inserted_blocks or seq.num_released_blocks:
            return None
        return self.cache.insert(seq.token_ids[:num_full * self.block_size], seq.block_table[:num_full],
                                 seq.request.extra_key)

    def drop_cache(self) -> None:
        """Forget every cached block (sequences keep theirs): after a failed step, blocks
        offered by `cache_scheduled_blocks` were never computed."""
        if self.cache is None:
            return
        self.cache.clear()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks the first `num_tokens` tokens need (and at most that many computed
        tokens): the tail of rejected draft tokens, or a rolled-back output, goes back to the
        pool. Blocks the prefix cache holds stay cached (only this sequence's reference goes).
        A shared block (cached, or a sibling's) cut in the middle goes too, so this sequence's
        next tokens never overwrite K/V that others read; its first tokens are recomputed."""
        keep = -(-num_tokens // self.block_size)
        if (num_tokens % self.block_size and keep <= len(seq.block_table)
                and self.pool.ref_counts[seq.block_table[keep - 1]] > 1):
            keep -= 1
        computed = min(seq.num_computed_tokens, num_tokens, keep * self.block_size)
        if seq.num_released_blocks and self._window_start(computed) < seq.num_released_blocks * self.block_size:
            self.free(seq)   # the next query's window reaches given-back blocks: recompute from the start
            return
        for block in seq.block_table[keep:]:
            self.pool.decref(block)
        del seq.block_table[keep:]
        seq.num_computed_tokens = computed
        seq.num_inserted_blocks = min(seq.num_inserted_blocks, keep)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full prompt blocks; the child recomputes the partial tail."""
        num_full = parent.num_prompt_tokens // self.block_size
        released = min(parent.num_released_blocks, num_full)
        if released and self._window_start(num_full * self.block_size) < released * self.block_size:
            return   # its window would reach given-back blocks: it computes its prompt from the start
        child.block_table = parent.block_table[:num_full]
        child.num_released_blocks = released
        for block in child.block_table[child.num_released_blocks:]:
            self.pool.incref(block)
        child.num_computed_tokens = num_full * self.block_size
        child.num_inserted_blocks = min(parent.num_inserted_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table[seq.num_released_blocks:]:
            self.pool.decref(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_inserted_blocks = 0
        seq.num_released_blocks = 0
