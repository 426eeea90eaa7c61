"""`--kv-events-config`: the prefix cache's events reach a ZMQ subscriber in vLLM's wire layout
(msgpack array batches of tagged BlockStored / BlockRemoved / AllBlocksCleared), numbered, with
a replay socket; the engine never waits on the publisher."""

from __future__ import annotations

import argparse

import msgpack
import pytest
from helpers.serve_process import free_port
import zmq

from kubeinfer.server.engine.block_pool import BlockPool
from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.kv_event_publisher import (END_OF_REPLAY, KVEventsConfig, ZmqKVEventPublisher,
                                                        parse_kv_events_config)
from kubeinfer.server.engine.kv_events import ExtraKey, KVEventLog, block_hashes
from kubeinfer.server.engine.radix_cache import RadixCache
from kubeinfer.server.flags import ENGINE_FLAGS, add_flags, to_args

pytestmark = pytest.mark.unit

BS = 4



def _signed(values: list[int]) -> list[int]:
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


@pytest.fixture
def wired(tmp_path):
    """A radix cache whose log publishes on an ipc PUB socket, a subscriber, and the replay port."""
    replay_port = free_port()
    config = parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": f"ipc://{tmp_path}/kv.sock",
                                     "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                                     "topic": "kv@pod-a", "buffer_steps": 100})
    publisher = ZmqKVEventPublisher(config, BS)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"ipc://{tmp_path}/kv.sock")
    pool, events = BlockPool(64), KVEventLog(BS, publisher=publisher)
    cache = RadixCache(pool, BS, events)
    _await_subscription(cache, pool, sub)
    yield pool, cache, sub, context, replay_port
    sub.close(0)
    context.term()
    events.close()


def _store(pool: BlockPool, cache: RadixCache, tokens: list[int], key: ExtraKey = ExtraKey()) -> None:
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks, key)
    for block in blocks:
        pool.decref(block)


def _await_subscription(cache: RadixCache, pool: BlockPool, sub: zmq.Socket) -> None:
    """PUB drops what it sends before the subscription arrives: clear until one batch is seen."""
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    for _ in range(100):
        cache.clear()
        if poller.poll(100):
            while poller.poll(200):   # drain every clear already published
                sub.recv_multipart()
            return
    raise AssertionError("the subscriber never received a batch")


def _recv(sub: zmq.Socket) -> tuple[bytes, int, list]:
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


def test_events_reach_a_subscriber_in_vllms_layout(wired):
    pool, cache, sub, _, _ = wired
    prompt = list(range(100, 112))
    _store(pool, cache, prompt)
    topic, seq, batch = _recv(sub)
    assert topic == b"kv@pod-a" and isinstance(batch[0], float) and len(batch) == 2   # [ts, events]
    hashes = _signed(block_hashes(prompt, BS))
    assert batch[1] == [["BlockStored", hashes, None, prompt, BS, None, "GPU", None]]
    # a second prompt sharing 2 blocks: the new block names its parent; an adapter is named
    _store(pool, cache, prompt[:8] + [7, 7, 7, 7])
    _store(pool, cache, prompt[:4], ExtraKey(None, "sql-lora"))
    _, seq2, batch2 = _recv(sub)
    events = batch2[1] if len(batch2[1]) == 2 else batch2[1] + _recv(sub)[2][1]
    assert seq2 == seq + 1
    assert events[0] == ["BlockStored", _signed(block_hashes(prompt[:8] + [7, 7, 7, 7], BS))[2:],
                         hashes[1], [7, 7, 7, 7], BS, None, "GPU", None]
    assert events[1][0] == "BlockStored" and events[1][7] == "sql-lora" and events[1][2] is None
    assert events[1][1] == _signed(block_hashes(prompt[:4], BS, adapter="sql-lora"))
    cache.evict(64)
    removed = []
    while len(removed) < 5:
        for event in _recv(sub)[2][1]:
            assert event[0] == "BlockRemoved" and event[2] == "GPU"
            removed += event[1]
    assert sorted(removed) == sorted(hashes + _signed(block_hashes(prompt[:8] + [7] * 4, BS))[2:]
                                     + _signed(block_hashes(prompt[:4], BS, adapter="sql-lora")))
    cache.clear()
    assert _recv(sub)[2][1] == [["AllBlocksCleared"]]


def test_replay_returns_buffered_batches_then_the_end_marker(wired):
    pool, cache, sub, context, replay_port = wired
    first = _recv_after(lambda: _store(pool, cache, list(range(8))), sub)
    _recv_after(lambda: _store(pool, cache, list(range(50, 58))), sub)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart((b"", first[1].to_bytes(8, "big")))
    replies = []
    while True:
        _, seq, payload = dealer.recv_multipart()
        if seq == END_OF_REPLAY:
            assert payload == b""
            break
        replies.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1][0][3]))
    assert replies == [(first[1], list(range(8))), (first[1] + 1, list(range(50, 58)))]
    dealer.send_multipart((b"", b"short"))   # malformed: ignored, the publisher keeps going
    _recv_after(lambda: _store(pool, cache, list(range(60, 64))), sub)
    dealer.close(0)


def _recv_after(action, sub: zmq.Socket) -> tuple[bytes, int, list]:
    action()
    return _recv(sub)


def test_a_full_queue_drops_events_and_leaves_a_sequence_gap(tmp_path):
    config = parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/q.sock",
                                     "max_queue_size": 2})
    publisher = ZmqKVEventPublisher(config, BS)
    publisher._publish([["AllBlocksCleared"]])   # seq 0
    publisher._dropped = 3                       # as if the engine had outrun the thread
    publisher._publish([["AllBlocksCleared"]])
    assert [seq for seq, _ in publisher._buffer] == [0, 2]
    for _ in range(10_000):   # never blocks, whatever the thread does
        publisher.removed([1])
    publisher.close()


def test_the_flag_takes_vllms_json_and_refuses_what_it_does_not_know():
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS, environ={})
    text = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}'
    config = parser.parse_args(["--kv-events-config", text]).kv_events_config
    assert config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv")
    assert parser.parse_args(to_args({"kv_events_config": config})).kv_events_config == config
    assert EngineConfig(kv_events_config=text).kv_events_config == config
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    for bad, message in (('{"publisher": "kafka"}', "publisher"), ('{"hwm": 0}', "hwm"),
                         ('{"endpointt": "x"}', "unknown keys"), ("{not json", "not JSON"),
                         ('{"endpoint": "http://x"}', "endpoint")):
        with pytest.raises(ValueError, match=message):
            parse_kv_events_config(bad)
