"""Block hashes, and the event log through which a router learns what this engine caches.

The prefix cache is a radix tree over token ids, which a router on another host cannot walk.
It can recompute a chain of block hashes from the same token ids, so every cached block is
named by one (vLLM's KV events do the same):

    root(extra) = 0 when extra is None, else blake2b-64(b"kubeinfer-extra\\0" + utf8(extra))
    root(extra, adapter) = blake2b-64(b"kubeinfer-adapter\\0" + lp(adapter) + lp(extra or ""))
                           when a LoRA adapter is set (lp = le_u32 length + utf8 bytes)
    block i     = blake2b-64(le_u64(block i-1, or root(extra) for the first block)
                             + le_u32 of each of the block's token ids)

blake2b-64 is blake2b with an 8-byte digest, read as an unsigned little-endian integer.
Keyed (`kubeinfer-blake2b64-keyed-v1`, an engine given --kv-hash-key), every blake2b above is
blake2b's own keyed mode (a MAC) with key = blake2b-256 of the secret's text, so a hash that
leaves the pod tells nobody without the key whether a guessed prompt is cached;
`extra` is the cache namespace of the request (its `cache_salt`) and `adapter` its LoRA adapter
(`ExtraKey`), so salted tenants and adapters get disjoint hashes. Only full blocks are hashed. This module imports nothing heavy: the router
(no torch) computes the same hashes with `block_hashes`.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import struct
import threading
from collections import deque
from typing import Any, Iterable, NamedTuple, Protocol, Sequence

HASH_SCHEME = "kubeinfer-blake2b64-v1"
KEYED_HASH_SCHEME = "kubeinfer-blake2b64-keyed-v1"


class ExtraKey(NamedTuple):
    """What a block's KV depends on besides its tokens (SGLang's `RadixKey.extra_key`): the
    tenant's `cache_salt` and the LoRA adapter. The prefix cache shares blocks only under equal
    keys; LoRA plugs in by setting `adapter`, without touching the cache."""

    salt: str | None = None
    adapter: str | None = None


class BlockHasher:
    """The chain of block hashes, unkeyed (the public scheme) or keyed with a secret shared by
    one InferenceService's engines and routers."""

    def __init__(self, secret: str | None = None) -> None:
        self.key = hashlib.blake2b(secret.encode(), digest_size=32).digest() if secret else b""
        self.scheme = KEYED_HASH_SCHEME if secret else HASH_SCHEME

    def _digest(self, data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=self.key).digest(), "little")

    def root(self, extra: str | None, adapter: str | None = None) -> int:
        """The parent of a namespace's first block."""
        if adapter is not None:
            data = b"".join(len(part).to_bytes(4, "little") + part for part in (adapter.encode(), (extra or "").encode()))
            return self._digest(b"kubeinfer-adapter\0" + data)
        if extra is None:
            return 0
        return self._digest(b"kubeinfer-extra\0" + extra.encode())

    def block(self, parent: int, tokens: Sequence[int]) -> int:
        return self._digest(parent.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}I", *tokens))

    def chain(self, parent: int, tokens: Sequence[int], block_size: int) -> list[int]:
        """Hashes of the full blocks of `tokens`, continuing the chain after `parent`."""
        hashes = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = self.block(parent, tokens[start:start + block_size])
            hashes.append(parent)
        return hashes

    def prompt(self, tokens: Sequence[int], block_size: int, extra: str | None = None,
               adapter: str | None = None) -> list[int]:
        """The hash of every full block of a prompt's `tokens` in namespace `extra` (and `adapter`)."""
        return self.chain(self.root(extra, adapter), tokens, block_size)


UNKEYED = BlockHasher()
root_hash, block_hash, chain_hashes, block_hashes = UNKEYED.root, UNKEYED.block, UNKEYED.chain, UNKEYED.prompt


class KVEventPublisher(Protocol):
    """Where the log also sends each event (vLLM's ZMQ publisher: `kv_event_publisher.py`)."""

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               lora_name: str | None) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...

    def close(self) -> None: ...


class KVEventLog:
    """Stored/removed block hashes with a sequence number, readable from another thread.

    `since(seq)` answers the net change after `seq`, or the whole set (`reset`) when the
    caller is new, too far behind (the log keeps `capacity` events), or the cache was cleared.
    `epoch` changes with every process, so a reader notices an engine restart. A `publisher`
    gets every event too, with the tokens and parent a vLLM-style subscriber needs.
    """

    def __init__(self, block_size: int, capacity: int = 8192,
                 publisher: KVEventPublisher | None = None, hasher: BlockHasher = UNKEYED) -> None:
        self.block_size, self.hasher = block_size, hasher
        self.publisher = publisher
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._seq = 0
        self._reset_seq = 0
        self._events: deque[tuple[bool, tuple[int, ...]]] = deque(maxlen=capacity)
        self._live: set[int] = set()

    def stored(self, hashes: Sequence[int], parent: int | None = None, tokens: Sequence[int] = (),
               key: ExtraKey = ExtraKey()) -> None:
        """Blocks `hashes` holding `tokens`, chained after block `parent` (None: the first blocks)."""
        self._record(True, tuple(hashes))
        if self.publisher is not None and hashes:
            self.publisher.stored(hashes, parent, tokens, key.adapter)

    def removed(self, hashes: Iterable[int]) -> None:
        hashes = tuple(hashes)
        self._record(False, hashes)
        if self.publisher is not None and hashes:
            self.publisher.removed(hashes)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def _record(self, stored: bool, hashes: tuple[int, ...]) -> None:
        if not hashes:
            return
        with self._lock:
            self._seq += 1
            self._events.append((stored, hashes))
            if stored:
                self._live.update(hashes)
            else:
                self._live.difference_update(hashes)

    def cleared(self) -> None:
        with self._lock:
            self._seq += 1
            self._reset_seq = self._seq
            self._events.clear()
            self._live.clear()
        if self.publisher is not None:
            self.publisher.cleared()

    def __len__(self) -> int:
        return len(self._live)

    def since(self, seq: int | None) -> dict[str, Any]:
        """The JSON body of `GET /kv/blocks?since=seq` (format in docs/engine.md)."""
        with self._lock:
            oldest = self._seq - len(self._events) + 1   # seq of the first event kept
            head = {"hash": self.hasher.scheme, "block_size": self.block_size, "epoch": self.epoch,
                    "seq": self._seq}
            if seq is None or seq < max(self._reset_seq, oldest - 1) or seq > self._seq:
                return {**head, "reset": True, "stored": sorted(self._live), "removed": []}
            net: dict[int, bool] = {}
            for stored, hashes in itertools.islice(self._events, seq - oldest + 1, None):
                for value in hashes:
                    net[value] = stored
        return {**head, "reset": False, "stored": sorted(h for h, s in net.items() if s),
                "removed": sorted(h for h, s in net.items() if not s)}
