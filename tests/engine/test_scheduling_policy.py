"""Scheduling policies (`scheduling_policy.py`): fair shares among tenants, priority first,
aging against starvation, and one tenant scheduled exactly as the default policy does.

The fuzz test drives the real scheduler and KV manager with the fake model of
test_scheduler.py under random arrivals, tenants, priorities, aborts and preemptions."""

from __future__ import annotations

import time

from hypothesis import given, settings, strategies as st
import pytest

from test_scheduler import FakeModel, drive

from kubeinfer.server.engine.kv_cache_manager import KVCacheManager
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.scheduler import Scheduler
from kubeinfer.server.engine.scheduling_policy import FairPolicy, PriorityPolicy
from kubeinfer.server.fair_share import MAX_IDLE_TENANTS
from kubeinfer.server.engine.sequence import Request, SequenceStatus

pytestmark = pytest.mark.unit

BS = 4


def request(rid: str, tenant: str = "", prompt_len: int = 5, max_tokens: int = 4, priority: int = 0,
            n: int = 1) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, priority=priority, ignore_eos=True)
    made = Request(rid, [1 + len(rid) % 2] * prompt_len, params, frozenset(), 1024)
    made.tenant = tenant
    return made


def scheduler(policy, num_blocks: int = 256, max_num_seqs: int = 2, budget: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, False), max_num_seqs, budget, policy)


def finish_done(sched: Scheduler, requests: list[Request]) -> None:
    for req in requests:
        for seq in req.seqs:
            if seq.status is not SequenceStatus.FINISHED and seq.num_tokens >= req.max_total_tokens:
                sched.finish(seq)


def step_once(sched: Scheduler, model: FakeModel) -> list[str]:
    """One step; the ids of the requests it scheduled, in the step's order."""
    out = sched.schedule()
    tokens = model.step(out)
    sched.update(out)
    for item, token in zip(out.scheduled, tokens):
        if item.samples:
            item.seq.token_ids.append(token)
    return [item.seq.request.request_id for item in out.scheduled]


def admitted_order(sched: Scheduler, requests: list[Request], model: FakeModel | None = None,
                   steps: int = 500) -> list[str]:
    """Request ids in the order they were first scheduled, stepping until all finish."""
    model, order = model or FakeModel(sched.kv), []
    for _ in range(steps):
        if not sched.num_unfinished_seqs:
            break
        order += [rid for rid in step_once(sched, model) if rid not in order]
        finish_done(sched, requests)
    return order


operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=20), st.integers(1, 8),
              st.integers(1, 2), st.none(), st.integers(-1, 2), st.sampled_from(["", "a", "b", "c"])),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("preempt"), st.integers(0, 100)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(10, 24), st.sampled_from([4, 8, 16]), st.integers(1, 4),
       st.sampled_from([None, 1e-9, 3600.0]))
def test_fair_policy_never_leaks_loses_or_starves_a_request(ops, num_blocks, budget, max_seqs, aging):
    policy = FairPolicy(aging)
    kv = KVCacheManager(num_blocks, BS, True)
    sched = Scheduler(kv, max_seqs, budget, policy)
    requests = drive(ops, sched, FakeModel(kv), num_blocks * BS)
    for req in requests:   # none lost or starved: every one ran to its length or was aborted
        assert req.finished
        if not req.aborted:
            assert all(seq.num_tokens == req.max_total_tokens for seq in req.seqs)
    assert kv.pool.num_free == num_blocks - kv.cache.num_cached_blocks
    assert policy.share.active == {}   # every arrival departed once


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 2), st.integers(0, 3)),
                min_size=1, max_size=16),
       st.integers(1, 4), st.sampled_from([4, 8, 16]))
def test_one_tenant_is_scheduled_exactly_as_the_priority_policy(arrivals, max_seqs, budget):
    """Same arrivals (prompt length, output length, priority, steps before the next): with one
    tenant, the fair policy's every step equals the default policy's."""
    runs = []
    for policy in (PriorityPolicy(), FairPolicy()):
        sched = scheduler(policy, num_blocks=12, max_num_seqs=max_seqs, budget=budget)
        model, requests, steps = FakeModel(sched.kv), [], []
        for i, (prompt_len, max_tokens, priority, gap) in enumerate(arrivals):
            requests.append(request(str(i), "", prompt_len, max_tokens, priority))
            sched.add_request(requests[-1])
            for _ in range(gap):
                out = sched.schedule()
                steps.append([(item.seq.request.request_id, item.num_new_tokens) for item in out.scheduled])
                tokens = model.step(out)
                sched.update(out)
                for item, token in zip(out.scheduled, tokens):
                    if item.samples:
                        item.seq.token_ids.append(token)
                finish_done(sched, requests)
        steps.append(admitted_order(sched, requests, model))
        runs.append(steps)
    assert runs[0] == runs[1]


def test_a_newcomer_tenant_goes_before_a_busy_tenants_backlog():
    sched = scheduler(FairPolicy(), max_num_seqs=2)
    backlog = [request(f"a{i}", "a", max_tokens=8) for i in range(8)]
    for req in backlog:
        sched.add_request(req)
    model = FakeModel(sched.kv)
    out = sched.schedule()   # a0 and a1 run; a2..a7 wait
    tokens = model.step(out)
    sched.update(out)
    for item, token in zip(out.scheduled, tokens):
        item.seq.token_ids.append(token)
    newcomer = request("b0", "b", max_tokens=8)
    sched.add_request(newcomer)
    order = admitted_order(sched, backlog + [newcomer], model)
    assert order[:2] == ["a0", "b0"]   # the very next step, in a1's place (a holds 2 slots, b none)
    fcfs = scheduler(PriorityPolicy(), max_num_seqs=2)
    same = [request(f"a{i}", "a", max_tokens=8) for i in range(8)] + [request("b0", "b", max_tokens=8)]
    for req in same:
        fcfs.add_request(req)
    assert admitted_order(fcfs, same)[-1] == "b0"   # the default policy: behind all of a's


@pytest.mark.parametrize("policy", [FairPolicy(), PriorityPolicy()], ids=["fair", "priority"])
def test_a_tenant_holding_every_slot_gives_one_up_to_a_newcomer(policy):
    sched = scheduler(policy, max_num_seqs=2)
    held = [request(f"a{i}", "a", max_tokens=16) for i in range(3)]
    for req in held:
        sched.add_request(req)
    model = FakeModel(sched.kv)
    assert step_once(sched, model) == ["a0", "a1"]
    sched.add_request(newcomer := request("b0", "b", max_tokens=16))
    scheduled = step_once(sched, model)
    if isinstance(policy, FairPolicy):
        assert scheduled == ["a0", "b0"]   # a1, a's newest, gave way in this very step
        assert held[1].seqs[0].status is SequenceStatus.WAITING and sched.num_preemptions == 1
        assert newcomer.seqs[0].status is SequenceStatus.RUNNING
    else:
        assert scheduled == ["a0", "a1"] and sched.num_preemptions == 0   # today's: b0 waits for a slot
    admitted_order(sched, held + [newcomer], model)
    assert all(r.finished for r in held + [newcomer]) and sched.kv.num_used_blocks == 0


@pytest.mark.parametrize("may_start", [True, False])
def test_a_newcomer_displaces_only_if_the_admission_check_lets_it_start(may_start):
    """The scheduler's `admit` (LoRA: an adapter slot) is asked before anyone is preempted for a
    newcomer; one that may not start yet leaves the running sequences alone."""
    asked: list[str] = []

    def admit(seq, sched: Scheduler) -> bool:
        asked.append(seq.request.request_id)
        return may_start or seq.request.tenant != "b"

    sched = Scheduler(KVCacheManager(256, BS, False), 2, 64, FairPolicy(), admit=admit)
    held = [request(f"a{i}", "a", max_tokens=16) for i in range(2)]
    for req in held:
        sched.add_request(req)
    model = FakeModel(sched.kv)
    step_once(sched, model)
    sched.add_request(request("b0", "b", max_tokens=16))
    scheduled = step_once(sched, model)
    assert "b0" in asked
    assert scheduled == (["a0", "b0"] if may_start else ["a0", "a1"])
    assert sched.num_preemptions == (1 if may_start else 0)


def test_tenants_do_not_trade_a_slot_back_and_forth():
    """Three slots, two backlogged tenants: 2 against 1 is as even as it gets, so nobody is
    preempted (a swap would only turn it into 1 against 2)."""
    sched = scheduler(FairPolicy(), max_num_seqs=3)
    backlog = [request(f"{t}{i}", t, max_tokens=6) for i in range(8) for t in "ab"]
    for req in backlog:
        sched.add_request(req)
    admitted_order(sched, backlog)
    assert all(r.finished for r in backlog) and sched.num_preemptions == 0


def test_a_tenant_does_not_take_a_slot_from_a_better_priority():
    sched = scheduler(FairPolicy(), max_num_seqs=2)
    urgent = [request(f"a{i}", "a", max_tokens=8, priority=0) for i in range(2)]
    for req in urgent:
        sched.add_request(req)
    model = FakeModel(sched.kv)
    step_once(sched, model)
    sched.add_request(request("b0", "b", max_tokens=8, priority=5))
    assert step_once(sched, model) == ["a0", "a1"] and sched.num_preemptions == 0


def test_backlogged_tenants_get_equal_tokens_not_equal_requests():
    """Tenant a sends long requests, b short ones, both backlogged: while both wait, computed
    tokens stay within what the running slots hold (admission is the unit: a running request is
    not paused for fairness), so b runs many more requests."""
    policy = FairPolicy()
    sched = scheduler(policy, max_num_seqs=2, budget=64)
    longs = [request(f"a{i}", "a", prompt_len=8, max_tokens=24) for i in range(12)]
    shorts = [request(f"b{i}", "b", prompt_len=4, max_tokens=4) for i in range(40)]
    for req in longs + shorts:
        sched.add_request(req)
    model = FakeModel(sched.kv)
    computed = {"a": 0, "b": 0}
    for _ in range(120):
        out = sched.schedule()
        for item in out.scheduled:
            computed[item.seq.request.tenant] += item.num_new_tokens
        tokens = model.step(out)
        sched.update(out)
        for item, token in zip(out.scheduled, tokens):
            if item.samples:
                item.seq.token_ids.append(token)
        finish_done(sched, longs + shorts)
        if any(not r.finished for r in longs) and any(not r.finished for r in shorts):
            assert abs(computed["a"] - computed["b"]) <= 2 * 32 + 8   # two slots of long requests
    assert sum(r.finished for r in shorts) > 2 * sum(r.finished for r in longs)


def test_priority_comes_before_fairness_and_preemption_takes_the_worst_priority():
    sched = scheduler(FairPolicy(), num_blocks=4, max_num_seqs=4, budget=16)
    low = request("low", "a", prompt_len=7, max_tokens=8, priority=5)
    high = request("high", "b", prompt_len=7, max_tokens=8, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out = sched.schedule()
    assert [i.seq.request.request_id for i in out.scheduled] == ["high", "low"]
    model = FakeModel(sched.kv)
    for _ in range(2):   # both prefilled then decoding into their second block: the pool is full
        tokens = model.step(out)
        sched.update(out)
        for item, token in zip(out.scheduled, tokens):
            if item.samples:
                item.seq.token_ids.append(token)
        out = sched.schedule()
    assert low.seqs[0].status is SequenceStatus.WAITING and high.seqs[0].status is SequenceStatus.RUNNING


def test_aging_lets_a_low_priority_request_past_a_stream_of_high_priority_ones():
    policy = FairPolicy(aging_seconds=10.0)
    sched = scheduler(policy, max_num_seqs=1)
    old_low = request("low", "a", priority=3)
    sched.add_request(old_low)
    highs = [request(f"h{i}", "a", priority=0) for i in range(3)]
    for req in highs:
        sched.add_request(req)
    assert [s.request.request_id for s in policy.admission_order(sched.waiting)][0] == "h0"
    old_low.metrics.arrival_time = time.monotonic() - 31   # waited 3 levels' worth: now in the top band
    assert [s.request.request_id for s in policy.admission_order(sched.waiting)][0] == "low"


def test_idle_tenants_are_forgotten_past_the_bound():
    """Each tenant leaves a debt (its tokens) when it goes idle; a gateway naming ever new
    tenants cannot grow the table past the bound."""
    policy = FairPolicy()
    sched = scheduler(policy, max_num_seqs=4)
    for i in range(MAX_IDLE_TENANTS + 10):
        req = request(f"t{i}", f"tenant-{i}", max_tokens=1)
        sched.add_request(req)
        admitted_order(sched, [req])
        assert len(policy.share.virtual_time) <= MAX_IDLE_TENANTS + 1
    assert policy.share.active == {}
