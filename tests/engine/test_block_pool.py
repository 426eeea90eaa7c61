"""BlockPool: exact free counts, reference counting, no double free."""

import pytest
from hypothesis import given, settings, strategies as st

from kubeinfer.server.engine.block_pool import BlockPool

pytestmark = pytest.mark.unit


def test_free_count_is_exact_and_blocks_come_back():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free == 3
    pool.incref(blocks[0])
    for block in blocks:
        pool.decref(block)
    assert pool.num_free == 7  # blocks[0] still has one reference
    pool.decref(blocks[0])
    assert pool.num_free == 8


def test_the_block_freed_last_is_reused_first():
    """Serving keeps writing the cache pages it already touched (they are mapped on first write)."""
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    pool.decref(1)
    pool.decref(0)
    assert pool.allocate(3) == [0, 1, 3]


def test_double_free_is_refused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.decref(block)
    with pytest.raises(AssertionError, match="double free"):
        pool.decref(block)


def test_empty_pool_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]),
                          st.integers(0, 10**6)), max_size=80))
def test_random_operations_keep_counts_consistent(ops):
    pool = BlockPool(16)
    refs: dict[int, int] = {}  # our own model of who holds what
    for op, value in ops:
        if op == "alloc":
            count = value % 4
            if count <= pool.num_free:
                for block in pool.allocate(count):
                    assert block not in refs
                    refs[block] = 1
        elif refs:
            block = sorted(refs)[value % len(refs)]
            if op == "incref":
                pool.incref(block)
                refs[block] += 1
            else:
                pool.decref(block)
                refs[block] -= 1
                if refs[block] == 0:
                    del refs[block]
        assert pool.num_free == 16 - len(refs)
        assert all(pool.ref_counts[b] == n for b, n in refs.items())
