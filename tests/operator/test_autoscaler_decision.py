"""The autoscaler's pure decision: issue #7's rules replayed over synthetic histories."""

from __future__ import annotations

import json

import pytest

from kubeinfer.operator.autoscaler.decision import MAX_READINGS, Decision, PodSample, decide
from kubeinfer.operator.autoscaler.policy import ScalingPolicy
from kubeinfer.operator.autoscaler.state import Reading, ScalerState

pytestmark = pytest.mark.unit

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
POLICY = ScalingPolicy(min_replicas=1, max_replicas=4, metric="queueDepth", target=2,
                       window_seconds=30, scale_down_delay_seconds=60)


def pods(*waiting: float | None, running: float = 0, not_ready: int = 0) -> list[PodSample]:
    """Ready pods with these queue depths (None = scrape failed), plus pods still starting."""
    ready = [PodSample(f"p{i}", True, None if w is None else {WAITING: w, RUNNING: running})
             for i, w in enumerate(waiting)]
    return ready + [PodSample(f"s{i}", False) for i in range(not_ready)]


class Replay:
    """Feeds one tick every 10 s and applies each decision, as the handler does."""

    def __init__(self, policy: ScalingPolicy = POLICY, replicas: int = 1) -> None:
        self.policy, self.replicas, self.now, self.state = policy, replicas, 1000.0, ScalerState()
        self.history: list[int] = []

    def tick(self, samples: list[PodSample], held: int = 0, draining: int = 0) -> Decision:
        decision = decide(self.policy, samples, self.state, self.replicas, self.now, held,
                          draining)
        self.state, self.replicas = decision.state, decision.desired
        self.history.append(decision.desired)
        self.last = decision
        self.now += 10
        return decision


def test_flat_load_holds_steady_at_ceil_of_sum_over_target() -> None:
    replay = Replay(replicas=3)
    for _ in range(20):  # 2.5 + 2.5 + 0 waiting at target 2 -> ceil(5 / 2) = 3
        decision = replay.tick(pods(2.5, 2.5, 0))
    assert set(replay.history) == {3}
    assert decision.average == pytest.approx(5.0) and decision.proposal == 3


def test_spike_scales_up_immediately_but_at_most_double_per_step() -> None:
    replay = Replay(replicas=1)
    first = replay.tick(pods(40))
    assert first.desired == 2 and "step bound" in first.reason
    replay.tick(pods(20, 20))
    assert replay.history == [2, 4]  # then clamped by maxReplicas


def test_one_tick_spike_is_averaged_and_does_not_outlive_the_delay() -> None:
    replay = Replay(replicas=1)
    for _ in range(3):
        replay.tick(pods(0))
    replay.tick(pods(8))  # window avg (0+0+0+8)/3 samples in 30 s -> 8/3 -> 2 replicas
    assert replay.replicas == 2
    for _ in range(5):
        replay.tick(pods(0, 0))
    assert replay.replicas == 2, "scaled down before scaleDownDelaySeconds"
    for _ in range(4):  # the spike leaves the 30 s window, then 60 s of lower proposals
        replay.tick(pods(0, 0))
    assert replay.history == [1, 1, 1] + [2] * 9 + [1]


def test_scale_down_goes_to_highest_proposal_of_the_delay_period() -> None:
    replay = Replay(replicas=4)
    for _ in range(3):
        replay.tick(pods(4, 4, 0, 0))  # 8 / 2 -> 4
    for _ in range(20):
        replay.tick(pods(1, 1, 1, 0))  # 3 / 2 -> proposal 2 once the window has slid
    assert replay.replicas == 2
    assert replay.history[:9] == [4] * 9, "scaled down before scaleDownDelaySeconds"
    assert replay.history == sorted(replay.history, reverse=True), "flapped on the way down"


def test_scrape_failure_is_never_read_as_zero_load() -> None:
    replay = Replay(replicas=3)
    for _ in range(15):
        decision = replay.tick(pods(0, None, None))  # one idle pod, two unreachable
    assert replay.replicas == 2 and decision.scrape_failures == 2
    assert decision.average == pytest.approx(2 * POLICY.target)  # each counts as a full replica
    busy_peer = decide(POLICY, pods(3, None), ScalerState(), 2, 0.0)
    assert busy_peer.average == pytest.approx(6.0)  # an unreachable pod is as loaded as its peers


def test_all_scrapes_failing_holds_the_current_size() -> None:
    replay = Replay(replicas=3)
    for _ in range(20):
        decision = replay.tick(pods(None, None, None))
    assert set(replay.history) == {3} and decision.average is None
    assert "hold" in decision.reason and decision.scrape_failures == 3


def test_pods_not_yet_ready_are_neither_load_nor_capacity() -> None:
    replay = Replay(replicas=2)
    decision = replay.tick(pods(6, not_ready=1))  # only the Ready pod's queue counts: 6/2 -> 3
    assert decision.desired == 3 and "1/1 Ready" in decision.reason
    starting = replay.tick(pods(not_ready=3))
    assert starting.desired == 3 and "no pod is Ready" in starting.reason


@pytest.mark.parametrize(("waiting", "expected"), [(0.0, 2), (100.0, 3)])
def test_min_and_max_clamp_the_proposal(waiting: float, expected: int) -> None:
    policy = ScalingPolicy(min_replicas=2, max_replicas=3, target=1, window_seconds=10,
                           scale_down_delay_seconds=0)
    replay = Replay(policy, replicas=2)
    for _ in range(4):
        replay.tick(pods(waiting, waiting))
    assert replay.replicas == expected


def test_replicas_outside_the_bounds_are_clamped_at_once() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, target=1)
    assert decide(policy, pods(0, 0, 0, 0, 0), ScalerState(), 5, 0.0).desired == 2
    assert decide(policy, pods(not_ready=5), ScalerState(), 5, 0.0).desired == 2  # even on hold


def test_never_below_replicas_with_requests_in_flight() -> None:
    replay = Replay(replicas=3)
    for _ in range(12):
        replay.tick(pods(0, 0, 0, running=1))  # nothing queued, but all three are decoding
    assert replay.replicas == 3
    decision = replay.tick(pods(0, 0, 0, running=1))
    assert "3 decoding -> proposal 3" in decision.reason and decision.state.below_since is None
    for _ in range(6):  # the decoding ends: only now does the 60 s scale-down clock start
        replay.tick(pods(0, 0, 0))
    assert replay.replicas == 3
    replay.tick(pods(0, 0, 0))
    assert replay.replicas == 1


def test_no_further_step_down_while_removed_pods_still_drain() -> None:
    replay = Replay(replicas=3)
    for _ in range(8):
        replay.tick(pods(0, 0, 0))
    assert replay.replicas == 1
    replay.replicas = 2  # say the user scaled it again, and one old pod is still draining
    for _ in range(10):
        decision = replay.tick(pods(0, 0), draining=1)
    assert replay.replicas == 2 and "draining" in decision.reason
    assert replay.tick(pods(0, 0)).desired == 1


def test_scale_to_zero_after_idle_and_back_when_requests_are_held() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, target=2, window_seconds=20,
                           scale_down_delay_seconds=30)
    replay = Replay(policy, replicas=1)
    for _ in range(5):
        replay.tick(pods(0))
    assert replay.replicas == 0 and replay.history[:3] == [1, 1, 1]
    assert replay.tick([]).desired == 0  # no pods at all is idle at zero, not a hold
    assert replay.tick([], held=1).desired == 1  # the gateway holds a request


def test_gateway_scaling_from_zero_is_not_undone_before_the_delay() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, target=2, window_seconds=20,
                           scale_down_delay_seconds=30)
    replay = Replay(policy, replicas=0)
    for _ in range(6):
        replay.tick([])
    replay.replicas = 1  # the gateway patched the scale subresource between two ticks
    for _ in range(3):
        replay.tick(pods(0))  # its single request finished before the autoscaler saw it
    assert replay.history[-3:] == [1, 1, 1]
    replay.tick(pods(0))
    assert replay.replicas == 0


def test_restart_from_status_gives_the_same_decision() -> None:
    replay = Replay(replicas=1)
    for waiting in (3, 7, 9, 2, 0, 0, 0):
        replay.tick(pods(*[waiting] * replay.replicas))
    saved = json.loads(json.dumps(replay.last.to_status()))  # as stored by the API server
    restored = ScalerState.from_status(saved)
    for samples in (pods(0, 0, 0), pods(1, 0, 0)):
        live = decide(POLICY, samples, replay.state, replay.replicas, replay.now)
        again = decide(POLICY, samples, restored, replay.replicas, replay.now)
        assert (again.desired, again.average, again.reason) == \
               (live.desired, live.average, live.reason)


def test_kv_cache_usage_sums_fractions_against_a_fractional_target() -> None:
    policy = ScalingPolicy(metric="kvCacheUsage", target=0.5, max_replicas=4)
    samples = [PodSample(f"p{i}", True, {"vllm:kv_cache_usage_perc": 0.9}) for i in range(2)]
    assert decide(policy, samples, ScalerState(), 2, 0.0).proposal == 4  # 1.8 / 0.5


def test_policy_reads_the_crd_fields_and_refuses_bad_ones() -> None:
    policy = ScalingPolicy.from_spec({"minReplicas": 0, "maxReplicas": 5, "metric": "inFlight",
                                      "target": 3, "scaleDownDelaySeconds": 120})
    assert (policy.min_replicas, policy.gauges, policy.window_seconds) == \
           (0, (WAITING, RUNNING), 60.0)
    with pytest.raises(ValueError, match="minReplicas <= maxReplicas"):
        ScalingPolicy.from_spec({"minReplicas": 4, "maxReplicas": 2})
    with pytest.raises(ValueError, match="metric must be one of"):
        ScalingPolicy.from_spec({"metric": "cpu"})


def test_status_round_trip_is_exact_and_camel_case() -> None:
    state = ScalerState((Reading(1000.25, 3.5, 2),), below_since=990.0, below_peak=2, replicas=3)
    saved = json.loads(json.dumps(state.to_status()))
    assert saved == {"samples": [{"time": "1970-01-01T00:16:40.250000Z", "value": 3.5, "pods": 2}],
                     "belowSince": "1970-01-01T00:16:30.000000Z", "belowPeak": 2,
                     "observedReplicas": 3}
    assert ScalerState.from_status(saved) == state


def test_malformed_status_restarts_empty_instead_of_crashing() -> None:
    state = ScalerState.from_status({"samples": ["junk", {"time": "x", "value": 1, "pods": 1},
                                                 {"time": "1970-01-01T00:00:02Z", "value": 3,
                                                  "pods": 1}],
                                     "belowSince": "1970-01-01T00:00:01Z",  # without its peak
                                     "observedReplicas": True})
    assert state == ScalerState(readings=(Reading(2.0, 3.0, 1),))
    assert ScalerState.from_status(None) == ScalerState.from_status("junk") == ScalerState()


def test_window_is_capped_at_the_status_schema_limit() -> None:
    policy = ScalingPolicy(interval_seconds=1, window_seconds=3600, target=2, max_replicas=9)
    state = ScalerState(tuple(Reading(float(t), 2.0, 1) for t in range(800)))
    decision = decide(policy, pods(100), state, 1, 800.0)
    assert len(decision.state.readings) == MAX_READINGS
    assert decision.state.readings[-1] == Reading(800.0, 100.0, 1)
    status = decision.to_status()
    assert (status["proposedReplicas"], decision.proposal) == (2, 2)  # (719*2 + 100)/720 / 2
    assert decide(policy, pods(40), ScalerState(), 1, 0.0).to_status()["proposedReplicas"] == 20
