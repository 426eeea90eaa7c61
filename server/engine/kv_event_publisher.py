"""vLLM's KV-cache events over ZMQ (`--kv-events-config`), for llm-d-style precise prefix scorers.

The wire format is vLLM's (`vllm/distributed/kv_events.py`, msgspec structs with
`array_like=True, omit_defaults=True, tag=True`), which llm-d's kv-cache indexer and AIBrix decode:

    PUB frames:     [topic, seq (8 bytes, big-endian), msgpack(batch)]
    batch:          [ts, [event, ...]]                       (data_parallel_rank omitted: no DP)
    BlockStored:    ["BlockStored", block_hashes, parent_block_hash | None, token_ids, block_size,
                     lora_id (None), medium ("GPU"), lora_name | None]
    BlockRemoved:   ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared: ["AllBlocksCleared"]
    replay (ROUTER): a request [start_seq (8 bytes, big-endian)] is answered with every buffered
                     [seq, batch] from start_seq on, then [-1 (8 bytes, signed), b""].

Where it differs from vLLM: the block hashes are ours (`kv_events.py`: blake2b-64 chains over
token ids, salted by cache_salt and LoRA adapter), sent as signed 64-bit integers (the same
bits as GET /kv/blocks' unsigned ones) because consumers decode them as int64; vLLM's are
sha256-derived. A consumer that maps engine hashes to its own keys from `token_ids` and
`parent_block_hash` (as llm-d does) needs nothing else. `medium` is "GPU" for the engine's own
KV pool on any device, as vLLM names its primary tier; LoRA adapters are named (`lora_name`),
never numbered (`lora_id` is None).

Events leave the engine's step through a bounded queue to a publisher thread, which batches
whatever is queued. When the queue is full the event is dropped and the next batch skips a
sequence number, so a subscriber sees the gap (vLLM blocks the engine instead).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

log = logging.getLogger(__name__)

MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_MAX_BATCH_EVENTS = 1024   # events packed into one published batch at most


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` fields, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv-events-config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv-events-config: enable_kv_cache_events must be true or false")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv-events-config: endpoint must be tcp://, ipc:// or inproc://, got {self.endpoint!r}")

    @property
    def enabled(self) -> bool:
        """vLLM publishes when events are enabled and the publisher is not null."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def __str__(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """`--kv-events-config` JSON (or a dict) into a config; unknown keys are refused."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        if value.strip() in ("", "none", "None"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv-events-config is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("kv-events-config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
    config = KVEventsConfig(**value)
    if config.enable_kv_cache_events and config.publisher == "null":   # vLLM >= 0.11: zmq by default
        config = KVEventsConfig(**{**value, "publisher": "zmq"})
    return config


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def block_stored(hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int,
                 lora_name: str | None) -> list[Any]:
    return ["BlockStored", [_int64(h) for h in hashes], None if parent is None else _int64(parent),
            list(token_ids), block_size, None, MEDIUM, lora_name]


def block_removed(hashes: Sequence[int]) -> list[Any]:
    return ["BlockRemoved", [_int64(h) for h in hashes], MEDIUM]


def all_blocks_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: list[list[Any]]) -> bytes:
    import msgpack

    return msgpack.packb([ts, events], use_bin_type=True)


class ZmqKVEventPublisher:
    """vLLM's ZmqEventPublisher: a PUB socket, an optional ROUTER for replay, one thread."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        import zmq

        self.block_size = block_size
        self._queue: queue.Queue[list[Any] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self._dropped = 0   # events dropped since the last batch (queue full)
        self._drop_lock = threading.Lock()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        # vLLM's rule: bind a wildcard, ipc or inproc address; connect to any other
        if "*" in config.endpoint or "::" in config.endpoint or config.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kubeinfer-kv-events", daemon=True)
        self._thread.start()

    # -- the engine side: never blocks -------------------------------------------------------

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               lora_name: str | None) -> None:
        self._put(block_stored(hashes, parent, token_ids, self.block_size, lora_name))

    def removed(self, hashes: Sequence[int]) -> None:
        self._put(block_removed(hashes))

    def cleared(self) -> None:
        self._put(all_blocks_cleared())

    def _put(self, event: list[Any]) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._drop_lock:
                if not self._dropped:
                    log.warning("KV-event queue full: events dropped (subscribers see a sequence gap)")
                self._dropped += 1

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if first is None:
                break
            events = [first]
            while len(events) < _MAX_BATCH_EVENTS:
                try:
                    event = self._queue.get_nowait()
                except queue.Empty:
                    break
                if event is None:
                    self._running = False
                    break
                events.append(event)
            self._publish(events)

    def _publish(self, events: list[list[Any]]) -> None:
        with self._drop_lock:
            if self._dropped:
                self._seq += 1   # the gap tells subscribers they missed events
                self._dropped = 0
        payload = encode_batch(time.time(), events)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # noqa: BLE001 - a socket error must not end the thread
            log.exception("KV-event publish failed")
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV-event replay: ignored a malformed request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        """Publish what is queued, then close the sockets."""
        self._running = False
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


def open_kv_event_publisher(config: KVEventsConfig | None, block_size: int) -> ZmqKVEventPublisher | None:
    return ZmqKVEventPublisher(config, block_size) if config is not None and config.enabled else None
