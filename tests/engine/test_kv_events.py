"""The prefix cache names its blocks by chain hashes a router can recompute, and publishes
what enters and leaves it (GET /kv/blocks) as net changes since a sequence number."""

import pytest

from kubeinfer.server.engine.block_pool import BlockPool
from kubeinfer.server.engine.kv_events import (HASH_SCHEME, ExtraKey, KVEventLog, block_hash, block_hashes,
                                               root_hash)
from kubeinfer.server.engine.radix_cache import RadixCache

pytestmark = pytest.mark.unit

BS = 4


def _cache(num_blocks: int = 32) -> tuple[BlockPool, RadixCache, KVEventLog]:
    pool, events = BlockPool(num_blocks), KVEventLog(BS)
    return pool, RadixCache(pool, BS, events), events


def _store(pool: BlockPool, cache: RadixCache, tokens: list[int], salt: str | None = None,
           adapter: str | None = None) -> None:
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks, ExtraKey(salt, adapter))
    for block in blocks:
        pool.decref(block)


def _live(events: KVEventLog) -> set[int]:
    return set(events.since(None)["stored"])


def test_hash_chain_is_the_documented_one():
    import hashlib
    import struct

    first = hashlib.blake2b((0).to_bytes(8, "little") + struct.pack("<4I", 1, 2, 3, 4), digest_size=8)
    assert block_hash(0, [1, 2, 3, 4]) == int.from_bytes(first.digest(), "little")
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS) == [
        block_hash(0, [1, 2, 3, 4]), block_hash(block_hash(0, [1, 2, 3, 4]), [5, 6, 7, 8])]
    assert root_hash(None) == 0 and root_hash("a") != root_hash("b") != 0
    assert block_hashes([1, 2, 3, 4], BS, "a") != block_hashes([1, 2, 3, 4], BS, "b")


def test_cached_blocks_are_published_by_their_chain_hash():
    pool, cache, events = _cache()
    _store(pool, cache, list(range(12)))
    _store(pool, cache, list(range(8)) + [50, 51, 52, 53])   # splits the first edge after 2 blocks
    _store(pool, cache, list(range(8)), salt="tenant-a")
    expected = (set(block_hashes(list(range(12)), BS))
                | set(block_hashes(list(range(8)) + [50, 51, 52, 53], BS))
                | set(block_hashes(list(range(8)), BS, "tenant-a")))
    assert _live(events) == expected and len(expected) == 6
    _store(pool, cache, list(range(12)) + [7, 7, 7, 7])   # extends a node that was split
    assert block_hashes(list(range(12)) + [7, 7, 7, 7], BS)[-1] in _live(events)


def test_evicted_and_cleared_blocks_leave_the_published_set():
    pool, cache, events = _cache()
    _store(pool, cache, [1] * 8)
    _store(pool, cache, [2] * 8)
    cache.match_prefix([2] * 8)   # [1]* is now the least recently used
    assert cache.evict(2) == 2
    assert _live(events) == set(block_hashes([2] * 8, BS))
    cache.clear()
    assert _live(events) == set()
    assert len(events) == 0


def test_since_answers_net_changes_and_resets_readers_it_cannot_serve():
    events = KVEventLog(BS, capacity=3)
    first = events.since(None)
    assert first["reset"] and first["seq"] == 0 and first["hash"] == HASH_SCHEME
    events.stored([1, 2])
    events.stored([3])
    events.removed([2])
    events.stored([2])   # back again: net stored
    changes = events.since(1)
    assert not changes["reset"] and changes["seq"] == 4
    assert changes["stored"] == [2, 3] and changes["removed"] == []
    assert events.since(2)["stored"] == [2] and events.since(4)["stored"] == []
    events.removed([1])
    assert events.since(4)["removed"] == [1]
    assert events.since(0)["reset"]    # its events fell out of the 3 kept
    assert events.since(0)["stored"] == [2, 3]
    assert events.since(99)["reset"]   # a reader from the future: another process's seq
    events.cleared()
    assert events.since(5)["reset"] and events.since(6) == {**events.since(6), "reset": False}


def test_a_new_process_has_a_new_epoch():
    assert KVEventLog(BS).epoch != KVEventLog(BS).epoch


def test_an_adapter_gets_its_own_hash_chain_and_no_adapter_keeps_the_salt_one():
    import hashlib

    assert root_hash("tenant", None) == root_hash("tenant")
    data = b"kubeinfer-adapter\0" + (6).to_bytes(4, "little") + b"lora-a" + (6).to_bytes(4, "little") + b"tenant"
    assert root_hash("tenant", "lora-a") == int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    roots = {root_hash(None), root_hash("lora-a"), root_hash(None, "lora-a"), root_hash("lora-a", "lora-a")}
    assert len(roots) == 4
    pool, cache, events = _cache()
    _store(pool, cache, list(range(8)), salt="tenant", adapter="lora-a")
    assert _live(events) == set(block_hashes(list(range(8)), BS, "tenant", "lora-a"))


def test_keyed_hashes_are_blake2b_macs_that_match_no_unkeyed_hash():
    """A keyed engine publishes blake2b's keyed mode over the same chain: recomputable with the
    service's secret, disjoint from the public scheme and from another secret's hashes."""
    import hashlib
    import struct

    from kubeinfer.server.engine.kv_events import KEYED_HASH_SCHEME, BlockHasher

    hasher = BlockHasher("service-secret")
    key = hashlib.blake2b(b"service-secret", digest_size=32).digest()
    first = hashlib.blake2b((0).to_bytes(8, "little") + struct.pack("<4I", 1, 2, 3, 4), digest_size=8, key=key)
    assert hasher.block(0, [1, 2, 3, 4]) == int.from_bytes(first.digest(), "little")
    tokens = list(range(40))
    for salt, adapter in ((None, None), ("tenant-a", None), (None, "sql")):
        keyed = hasher.prompt(tokens, BS, salt, adapter)
        assert not set(keyed) & set(block_hashes(tokens, BS, salt, adapter))
        assert not set(keyed) & set(BlockHasher("other-secret").prompt(tokens, BS, salt, adapter))
    pool, events = BlockPool(32), KVEventLog(BS, hasher=hasher)
    cache = RadixCache(pool, BS, events)
    _store(pool, cache, tokens[:12], salt="tenant-a")
    assert _live(events) == set(hasher.prompt(tokens[:12], BS, "tenant-a"))
    assert events.since(None)["hash"] == KEYED_HASH_SCHEME and KVEventLog(BS).since(None)["hash"] == HASH_SCHEME
