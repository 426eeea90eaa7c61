"""Scheduler properties under random add / step / abort / preempt / truncate interleavings.

The model is replaced by a cheap deterministic test double: a fake KV store where each slot
records a hash of the token prefix it was computed for, and next tokens derived from that
hash. That lets the test check what matters to the scheduler: every sequence only ever
reads slots that hold its own prefix (prefix sharing, forks and preemption are all
correct), no block leaks or is double-freed, and every request finishes or is aborted.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
import pytest

from kubeinfer.server.engine.kv_cache_manager import KVCacheManager
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.scheduler import Scheduler, SchedulerOutput
from kubeinfer.server.engine.sequence import Request, Sequence, SequenceStatus

pytestmark = pytest.mark.unit

BS = 4


def _prefix_hashes(tokens: list[int]) -> list[int]:
    hashes, h = [], 17
    for token in tokens:
        h = hash((h, token))
        hashes.append(h)
    return hashes


class FakeModel:
    """Writes one hash per slot and checks each sequence's block table reads its own prefix."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[int, int] = {}

    def step(self, out: SchedulerOutput) -> list[int]:
        """Like a model layer: the step's K/V are all stored before any chunk attends."""
        written: set[int] = set()
        for item in out.scheduled:
            seq = item.seq
            hashes = _prefix_hashes(seq.token_ids)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            assert len(seq.block_table) * BS >= end
            for pos in range(start, end):
                slot = self._slot(seq, pos)
                assert slot not in written, "two chunks of one step wrote the same slot"
                written.add(slot)
                self.slots[slot] = hashes[pos]
        sampled = []
        for item in out.scheduled:
            seq = item.seq
            hashes = _prefix_hashes(seq.token_ids)
            for pos in range(self.first_key(seq), seq.num_computed_tokens):  # the cached keys it attends to
                assert self.slots.get(self._slot(seq, pos)) == hashes[pos], "read a foreign slot"
            end = seq.num_computed_tokens + item.num_new_tokens
            sampled.append(hashes[end - 1] % 3 if item.samples else -1)
        return sampled

    def first_key(self, seq: Sequence) -> int:
        """The first cached position a chunk of `seq` attends to."""
        return 0

    @staticmethod
    def _slot(seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS


def _check_references(kv: KVCacheManager, seqs: list[Sequence]) -> None:
    expected = [0] * kv.pool.num_blocks
    for seq in seqs:
        for block in seq.block_table[seq.num_released_blocks:]:   # blocks a sliding window left hold none
            expected[block] += 1
    assert kv.num_used_blocks == sum(1 for count in expected if count), "incremental used-block count drifted"
    if kv.cache is not None:
        for block in kv.cache.cached_blocks():
            expected[block] += 1
    assert kv.pool.ref_counts == expected
    assert kv.pool.num_free == expected.count(0)


def _run_step(sched: Scheduler, model: FakeModel, requests: list[Request]) -> None:
    out = sched.schedule()
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    tokens = model.step(out)
    fork_tokens = [(sib, (tokens[i] + sib.index) % 3) for sib, i in out.forks]
    sched.update(out)
    for item, token in zip(out.scheduled, tokens):
        if item.samples:
            item.seq.token_ids.append(token)
    for sibling, token in fork_tokens:
        sibling.token_ids.append(token)
    for request in requests:
        for seq in request.seqs:
            if (seq.status is not SequenceStatus.FINISHED
                    and seq.num_tokens >= request.max_total_tokens):
                sched.finish(seq)


def _roll_back(kv: KVCacheManager, seq: Sequence, cut: int) -> None:
    """Drop some of a sequence's output tokens (as rejected drafts or a rollback would) and give
    back the KV blocks past what the kept tokens need; the last kept token is recomputed."""
    keep = seq.num_prompt_tokens + cut % (seq.num_output_tokens + 1)
    del seq.token_ids[keep:]
    kv.truncate(seq, min(seq.num_computed_tokens, keep - 1))
    assert len(seq.block_table) * BS >= seq.num_computed_tokens
    assert seq.num_computed_tokens <= keep - 1 and seq.num_inserted_blocks <= len(seq.block_table)


def _abort(sched: Scheduler, request: Request) -> None:
    request.aborted = True
    for seq in request.seqs:
        if seq.status is not SequenceStatus.FINISHED:
            sched.finish(seq)


operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=24),
              st.integers(1, 8), st.integers(1, 3), st.sampled_from([None, "a"]),
              st.integers(0, 1)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("preempt"), st.integers(0, 100)),
    st.tuples(st.just("truncate"), st.integers(0, 100), st.integers(0, 100)),
), max_size=60)


def drive(ops: list[tuple], sched: Scheduler, model: FakeModel, max_total_tokens: int,
          extra_tokens: int = 0, settle_steps: int = 2000) -> list[Request]:
    """Apply hypothesis' operations, checking every reference count after each, then step until
    every request has finished; returns the requests (sliding-window tests drive the same way)."""
    kv = sched.kv
    requests: list[Request] = []
    for op in ops:
        if op[0] == "add":   # ("add", prompt, max_tokens, n, cache salt, priority[, tenant])
            _, prompt, max_tokens, n, salt, priority, *tenant = op
            params = SamplingParams(n=n, max_tokens=max_tokens + extra_tokens, cache_salt=salt,
                                    priority=priority, ignore_eos=True)
            request = Request(str(len(requests)), prompt, params, frozenset(), max_total_tokens)
            if tenant:
                request.tenant = tenant[0]
            requests.append(request)
            sched.add_request(request)
        elif op[0] == "step":
            _run_step(sched, model, requests)
        elif op[0] == "abort" and requests:
            _abort(sched, requests[op[1] % len(requests)])
        elif op[0] == "preempt" and sched.running:
            sched.preempt(sched.running[op[1] % len(sched.running)])
        elif op[0] == "truncate" and sched.running:
            _roll_back(kv, sched.running[op[1] % len(sched.running)], op[2])
        _check_references(kv, [s for r in requests for s in r.seqs])
    for _ in range(settle_steps):
        if not sched.num_unfinished_seqs:
            break
        _run_step(sched, model, requests)
        _check_references(kv, [s for r in requests for s in r.seqs])
    return requests


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(10, 24), st.sampled_from([4, 8, 16]), st.integers(1, 4),
       st.booleans())
def test_random_interleavings_never_leak_and_always_finish(ops, num_blocks, budget, max_seqs,
                                                           caching):
    kv = KVCacheManager(num_blocks, BS, caching)
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    model = FakeModel(kv)
    requests = drive(ops, sched, model, num_blocks * BS)
    for request in requests:
        assert request.finished
        if not request.aborted:
            assert all(seq.num_tokens == request.max_total_tokens for seq in request.seqs)
    assert kv.pool.num_free == num_blocks - (kv.cache.num_cached_blocks if kv.cache else 0)


def test_decodes_are_scheduled_before_prefill_chunks():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    model = FakeModel(kv)
    first = Request("a", [1] * 6, SamplingParams(max_tokens=4), frozenset(), 256)
    requests = [first]
    sched.add_request(first)
    _run_step(sched, model, requests)  # prefill "a" (6 tokens)
    second = Request("b", [2] * 20, SamplingParams(max_tokens=4), frozenset(), 256)
    requests.append(second)
    sched.add_request(second)
    out = sched.schedule()
    assert [(i.seq.request.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("a", 1), ("b", 7)]  # the decode first, then a chunk of the long prompt


def test_shared_prefix_is_computed_once():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    model = FakeModel(kv)
    prefix = [1, 2, 0, 1] * 4
    first = Request("a", prefix + [2], SamplingParams(max_tokens=2), frozenset(), 256)
    sched.add_request(first)
    _run_step(sched, model, [first])
    second = Request("b", prefix + [0, 0], SamplingParams(max_tokens=2), frozenset(), 256)
    sched.add_request(second)
    out = sched.schedule()
    assert second.num_cached_tokens == 16
    assert [(i.seq.request.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("a", 1), ("b", 2)]
    assert kv.prefix_cache_hits == 16 and kv.prefix_cache_queries == 17 + 18


def test_requests_arriving_together_compute_a_shared_prefix_once():
    """The second request of a prefix shares the blocks the first computes in the same step,
    and reads them only after they are written; a request with another prefix computes its own."""
    kv = KVCacheManager(64, BS, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    model = FakeModel(kv)
    prefix_a, prefix_b = [1, 2, 0, 1] * 4, [2, 2, 1, 0] * 4
    requests = [Request(rid, prefix + [tail], SamplingParams(max_tokens=2), frozenset(), 256)
                for rid, prefix, tail in [("a1", prefix_a, 0), ("a2", prefix_a, 1), ("b1", prefix_b, 2)]]
    for request in requests:
        sched.add_request(request)
    out = sched.schedule()
    assert [(i.seq.request.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("a1", 17), ("a2", 1), ("b1", 17)]
    assert [r.num_cached_tokens for r in requests] == [0, 16, 0]
    assert requests[1].seqs[0].block_table[:4] == requests[0].seqs[0].block_table[:4]
    assert all(item.samples for item in out.scheduled)   # every request's first token in this step
    tokens = model.step(out)   # a2 reads a1's blocks of this step: the fake model checks their hashes
    sched.update(out)
    for item, token in zip(out.scheduled, tokens):
        item.seq.token_ids.append(token)
    _check_references(kv, [s for r in requests for s in r.seqs])
    assert kv.cache.num_cached_blocks == 8   # 4 blocks of each prefix, once


def test_newest_request_is_preempted_when_blocks_run_out():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    model = FakeModel(kv)
    old = Request("old", [1] * 7, SamplingParams(max_tokens=8), frozenset(), 16)
    new = Request("new", [2] * 7, SamplingParams(max_tokens=8), frozenset(), 16)
    for request in (old, new):
        sched.add_request(request)
    _run_step(sched, model, [old, new])  # both prefilled: 2 blocks each, pool full
    _run_step(sched, model, [old, new])  # both decode into their second block
    out = sched.schedule()  # "old" needs a third block: "new" gives way
    assert [i.seq.request.request_id for i in out.scheduled] == ["old"]
    assert sched.num_preemptions == 1 and new.seqs[0].status is SequenceStatus.WAITING


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.integers(0, 40), st.integers(0, 40),
       st.booleans())
def test_truncate_keeps_the_cache_and_the_other_sequence_intact(prompt, cut, shared_len, share_tail):
    """A sequence cut anywhere (even inside a block the cache or a sibling holds) keeps
    consistent references, never keeps a shared block it would write into, and the block it
    shared still matches the other sequence's prefix."""
    kv = KVCacheManager(32, BS, True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = Request("a", prompt, params, frozenset(), 32 * BS).seqs[0]
    kv.allocate_slots(first, len(prompt))
    kv.cache_scheduled_blocks(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(first)
    other = Request("b", prompt[:max(1, shared_len % (len(prompt) + 1))], params, frozenset(), 32 * BS).seqs[0]
    kv.match_prefix(other)
    shared = list(other.block_table)
    before = list(first.block_table)
    kv.truncate(first, cut % (len(prompt) + 1))
    _check_references(kv, [first, other])
    kept = first.block_table
    assert kept == before[:len(kept)] and first.num_computed_tokens <= len(kept) * BS
    if first.num_computed_tokens % BS:   # a partly kept block is written next: it must be this sequence's alone
        assert kv.pool.ref_counts[kept[-1]] == 1
    assert kv.cache.match_prefix(prompt) == before[:len(prompt) // BS]   # the cache lost nothing
    assert other.block_table == shared
    for seq in (first, other):
        kv.free(seq)
    _check_references(kv, [first, other])
