"""The router's queue (server/router/queue.py): requests waiting for a Ready replica or a free
slot are released by priority, then by a fair share of tokens across tenants, then arrival;
client disconnects, timeouts and a full queue lose nothing and leave nothing behind."""

from __future__ import annotations

import asyncio
import random

import pytest

from kubeinfer.server.router.activator import Activator, ActivatorConfig, GatewayMetrics, NoReadyPod, QueueFull
from kubeinfer.server.router.queue import Ticket

pytestmark = pytest.mark.unit


class Backends:
    """Ready replicas appear when the test adds them."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def ready(self) -> list[str]:
        return list(self.urls)

    async def wake(self) -> bool:
        return False

    def forget(self) -> None:
        pass


def activator(backends: Backends, slots: int = 1, timeout: float = 30.0, queued: int = 4096) -> Activator:
    config = ActivatorConfig(activation_timeout=timeout, poll_interval=0.01, wake_interval=60,
                             max_in_flight_per_replica=slots, max_queued_requests=queued)
    return Activator(backends, config, GatewayMetrics())


async def until(condition, seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.005)


async def release_order(tickets: list[Ticket]) -> list[int]:
    """Queue `tickets` in order at zero replicas, then let one replica with one slot serve them
    one at a time: the indices in the order the queue released them."""
    backends = Backends()
    gate = activator(backends)
    order: list[int] = []

    async def request(index: int) -> None:
        async with gate.upstream(ticket=tickets[index]):
            order.append(index)
            await asyncio.sleep(0)   # the slot frees when the answer ends

    tasks = []
    for index in range(len(tickets)):
        tasks.append(asyncio.create_task(request(index)))
        await until(lambda: len(gate.queue) == index + 1)   # queued in this order
    backends.urls.append("http://a")
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return order


async def test_a_high_priority_request_queued_after_low_ones_is_released_first() -> None:
    tickets = [Ticket("t", priority=5, cost=10)] * 3 + [Ticket("t", priority=0, cost=10)]
    assert await release_order(tickets) == [3, 0, 1, 2]


async def test_one_tenant_is_released_in_arrival_order() -> None:
    assert await release_order([Ticket()] * 5) == [0, 1, 2, 3, 4]


async def test_a_tenant_with_one_request_is_released_within_its_fair_share() -> None:
    heavy = [Ticket("heavy", cost=100)] * 8
    light = [Ticket("light", cost=100), Ticket("light", cost=100)]
    order = await release_order(heavy + light)
    # the light tenant's requests alternate with the heavy one's backlog instead of waiting behind it
    assert order[:4] == [0, 8, 1, 9]


async def test_tokens_from_the_answers_correct_the_estimate() -> None:
    backends = Backends()
    backends.urls.append("http://a")
    gate = activator(backends)
    async with gate.upstream(ticket=Ticket("a", cost=100)):   # estimated 100, the answer says 10
        gate.settle(Ticket("a", cost=100), 10)
        assert gate.share.standing("a") == 10


async def test_past_the_timeout_a_queued_request_is_refused_and_leaves_nothing() -> None:
    backends = Backends()
    backends.urls.append("http://a")
    gate = activator(backends, timeout=0.2)
    async with gate.upstream(ticket=Ticket("a")):
        with pytest.raises(NoReadyPod, match="max-in-flight-per-replica"):
            async with gate.upstream(ticket=Ticket("b")):
                pass
    assert len(gate.queue) == 0 and gate.in_flight["http://a"] == 0 and "b" not in gate.share.active


async def test_a_full_queue_refuses_at_once() -> None:
    gate = activator(Backends(), queued=2)
    waiting = [asyncio.create_task(gate.upstream(ticket=Ticket()).__aenter__()) for _ in range(2)]
    await until(lambda: len(gate.queue) == 2)
    with pytest.raises(QueueFull):
        async with gate.upstream():
            pass
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert len(gate.queue) == 0 and gate.share.active == {}


@pytest.mark.parametrize("seed", range(4))
async def test_random_tenants_priorities_and_disconnects_lose_nothing(seed: int) -> None:
    """Fault injection: requests of random tenants and priorities queue while replicas come and
    go and clients leave at random; every request is served, refused in time or cancelled, the
    queue stays within its bound, and nothing stays counted afterwards."""
    rng = random.Random(seed)
    backends = Backends()
    gate = activator(backends, slots=2, timeout=2.0, queued=24)
    served, refused, largest = [], [], 0

    async def request(index: int) -> None:
        ticket = Ticket(f"t{rng.randrange(4)}", rng.randrange(3), rng.randrange(1, 200))
        try:
            async with gate.upstream(ticket=ticket) as url:
                assert gate.in_flight[url] <= 2
                await asyncio.sleep(rng.random() * 0.02)
                gate.settle(ticket, rng.randrange(1, 200))
            served.append(index)
        except NoReadyPod:
            refused.append(index)

    tasks = []
    for index in range(120):
        tasks.append(asyncio.create_task(request(index)))
        largest = max(largest, len(gate.queue))
        action = rng.random()
        if action < 0.1 and tasks:
            rng.choice(tasks).cancel()   # a client disconnects, queued or in flight
        elif action < 0.15:
            backends.urls = [url for url in ("http://a", "http://b") if rng.random() < 0.6]
        await asyncio.sleep(rng.random() * 0.005)
    backends.urls = ["http://a", "http://b"]
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    cancelled = sum(isinstance(result, asyncio.CancelledError) for result in results)
    assert len(served) + len(refused) + cancelled == 120
    assert all(isinstance(result, asyncio.CancelledError) or result is None for result in results)
    assert largest <= 24 and len(gate.queue) == 0
    assert sum(gate.in_flight.values()) == 0 and gate.share.active == {}
    assert gate.metrics.registry.get_sample_value("kubeinfer_gateway_held_requests") == 0
