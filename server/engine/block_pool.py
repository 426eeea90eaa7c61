"""A fixed pool of KV-cache blocks with reference counts.

A block is shared copy-free by every sequence (and the prefix cache) that references it;
it returns to the free list when its last reference goes. The free list is a stack: the block
freed last is reused first, so a workload keeps writing memory it already touched. The CPU
cache's pages are mapped by a low-priority background thread (`cpu_cache_memory`); until it is
done, or where the kernel cannot do it, a queue sweeping the whole pool would take those page
faults inside forward passes.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV-cache pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = bytearray(num_blocks)   # 1 while the prefix cache holds one of the references
        # blocks some sequence references (kept as references change: stats read it every step)
        self.num_used = 0
        self._free = list(range(num_blocks - 1, -1, -1))   # block 0 on top

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks with one reference each; the caller checked num_free."""
        assert count <= len(self._free), f"asked for {count} blocks, {len(self._free)} free"
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        self.num_used += count
        return blocks

    def incref(self, block: int) -> None:
        """A sequence takes a reference on a block in use (shared prefix, fork, cache hit)."""
        assert self.ref_counts[block] > 0, f"block {block} is free"
        if self.ref_counts[block] == self.cached[block]:   # only the prefix cache held it
            self.num_used += 1
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """A sequence drops its reference; the block is free again when none remain."""
        assert self.ref_counts[block] > self.cached[block], f"double free of block {block}"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == self.cached[block]:
            self.num_used -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def cache_incref(self, block: int) -> None:
        """The prefix cache takes its (one) reference on a block a sequence holds."""
        assert self.ref_counts[block] > 0 and not self.cached[block], f"block {block} is free or cached"
        self.cached[block] = 1
        self.ref_counts[block] += 1

    def cache_decref(self, block: int) -> None:
        """The prefix cache drops its reference (eviction, clear)."""
        assert self.cached[block], f"block {block} is not cached"
        self.cached[block] = 0
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
