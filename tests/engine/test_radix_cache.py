"""RadixCache: block-granular prefix matching, sharing, LRU eviction of unreferenced leaves, salts
and adapters (one `ExtraKey`)."""

from hypothesis import given, settings, strategies as st
import pytest

from kubeinfer.server.engine.block_pool import BlockPool
from kubeinfer.server.engine.kv_cache_manager import KVCacheManager
from kubeinfer.server.engine.kv_events import ExtraKey
from kubeinfer.server.engine.radix_cache import RadixCache

pytestmark = pytest.mark.unit

BS = 4


def _cache(num_blocks: int = 32) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BS)


def _store(pool: BlockPool, cache: RadixCache, tokens: list[int], salt: str | None = None,
           adapter: str | None = None) -> list[int]:
    """Compute-and-cache as a sequence would: allocate, insert, drop the sequence's references."""
    blocks = pool.allocate(len(tokens) // BS)
    canonical = cache.insert(tokens, blocks, ExtraKey(salt, adapter))
    for block in blocks:
        pool.decref(block)
    return canonical


def test_match_returns_only_full_blocks_of_the_longest_prefix():
    pool, cache = _cache()
    stored = _store(pool, cache, list(range(12)))
    assert cache.match_prefix(list(range(12))) == stored
    assert cache.match_prefix(list(range(11))) == stored[:2]  # the partial third block is not used
    assert cache.match_prefix(list(range(6)) + [99] * 6) == stored[:1]
    assert cache.match_prefix([99] * 12) == []


def test_insert_splits_edges_and_reuses_existing_blocks():
    pool, cache = _cache()
    first = _store(pool, cache, list(range(12)))
    second = _store(pool, cache, list(range(8)) + [50, 51, 52, 53])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert cache.num_cached_blocks == 4
    assert pool.num_free == 32 - 4


def test_cache_salt_isolates_tenants():
    pool, cache = _cache()
    _store(pool, cache, list(range(8)), salt="tenant-a")
    assert cache.match_prefix(list(range(8)), ExtraKey("tenant-b")) == []
    assert cache.match_prefix(list(range(8))) == []
    assert len(cache.match_prefix(list(range(8)), ExtraKey("tenant-a"))) == 2


def test_eviction_takes_least_recently_used_unreferenced_leaves():
    pool, cache = _cache()
    old = _store(pool, cache, [1] * 8)
    new = _store(pool, cache, [2] * 8)
    held = _store(pool, cache, [3] * 8)
    for block in held:  # a running sequence reads these: not evictable
        pool.incref(block)
    cache.match_prefix([1] * 8)  # touch: [1]* is now more recent than [2]*
    assert cache.evict(1) == 2
    assert cache.match_prefix([2] * 8) == [] and cache.match_prefix([1] * 8) == old
    assert cache.evict(100) == 2  # only [1]* is left to evict
    assert cache.match_prefix([3] * 8) == held
    assert pool.num_free == 32 - 2


def test_inner_node_is_evicted_after_its_children():
    pool, cache = _cache()
    _store(pool, cache, list(range(8)))
    _store(pool, cache, list(range(4)) + [9] * 4)
    assert cache.evict(100) == 3
    assert cache.num_cached_blocks == 0 and pool.num_free == 32


token_lists = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=20), max_size=12)


@settings(max_examples=150, deadline=None)
@given(token_lists, st.lists(st.integers(0, 6), max_size=12))
def test_random_inserts_and_evictions_never_leak_blocks(sequences, evictions):
    pool, cache = _cache(64)
    for tokens, evict in zip(sequences, evictions + [0] * len(sequences)):
        needed = len(tokens) // BS
        if pool.num_free < needed:
            cache.evict(needed - pool.num_free)
        if pool.num_free < needed:
            continue
        canonical = _store(pool, cache, tokens)
        assert cache.match_prefix(tokens) == canonical
        cache.evict(evict)
        assert pool.num_free == 64 - cache.num_cached_blocks
        assert sorted(cache.cached_blocks()) == sorted(set(cache.cached_blocks()))
    cache.clear()
    assert pool.num_free == 64


def test_adapters_never_share_blocks_with_the_base_model_or_each_other():
    pool, cache = _cache()
    _store(pool, cache, list(range(8)), adapter="lora-a")
    _store(pool, cache, list(range(8)), salt="tenant", adapter="lora-a")
    assert cache.match_prefix(list(range(8))) == []
    assert cache.match_prefix(list(range(8)), ExtraKey(adapter="lora-b")) == []
    assert cache.match_prefix(list(range(8)), ExtraKey("tenant")) == []
    mine, salted = (cache.match_prefix(list(range(8)), key) for key in
                    (ExtraKey(adapter="lora-a"), ExtraKey("tenant", "lora-a")))
    assert len(mine) == len(salted) == 2 and not set(mine) & set(salted)


def test_a_sequence_is_cached_under_its_salt_and_adapter():
    from kubeinfer.server.engine.sampling_params import SamplingParams
    from kubeinfer.server.engine.sequence import Request

    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    prompt = list(range(9))
    first = Request("a", prompt, SamplingParams(cache_salt="t"), frozenset(), 64, adapter="lora-a").seqs[0]
    kv.allocate_slots(first, len(prompt))
    kv.cache_scheduled_blocks(first, len(prompt))
    for adapter, salt, hit in [("lora-a", "t", 8), ("lora-b", "t", 0), (None, "t", 0), ("lora-a", None, 0)]:
        seq = Request("b", prompt, SamplingParams(cache_salt=salt), frozenset(), 64, adapter=adapter).seqs[0]
        assert kv.match_prefix(seq) == hit, (adapter, salt)
        kv.free(seq)
