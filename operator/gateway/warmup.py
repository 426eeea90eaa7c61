"""Warm-up of replicas that become Ready with the service's hottest shared prefixes.

A replica added by a scale-up starts with an empty prefix cache, so the first requests of every
tenant it takes prefill their system prompt again. The router has seen those prompts: it keeps
a bounded record of the block-aligned prefixes that requests share (`HotPrefixes`, per cache
namespace: the request's `model`, which names a LoRA adapter too, and its `cache_salt`), and
when an engine becomes Ready it sends it the hottest few as prefill-only requests (`Warmer`:
`max_tokens: 1`, the prompt's token ids, the same `model` and `cache_salt`), a few at a time in
the background. Routing never waits for them; once the engine publishes the blocks
(`GET /kv/blocks`), the new replica is as good a choice for those tenants as the ones that
served them, and the load penalty sends it their share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import httpx

from .engine_views import EngineViews
from .routing_key import RoutingKey

log = logging.getLogger(__name__)


@dataclass(slots=True)   # up to `capacity` of them
class _Block:
    """One full block of prompts seen: the prefix through it, by its chained hash."""

    parent: int | None   # the previous block's hash
    depth: int           # blocks through this one
    tokens: tuple[int, ...]   # the prompt that first reached it (covers `depth` blocks at least)
    model: str | None
    salt: str | None
    count: int = 0       # requests whose prompt went through it
    max_child: int = 0   # the largest count of a block after it
    score: float = 0.0   # requests, each counting half after the half-life
    seen: float = 0.0


@dataclass(frozen=True)
class HotPrefix:
    model: str | None
    salt: str | None
    block_size: int
    tokens: tuple[int, ...]   # whole blocks
    hashes: tuple[int, ...]   # their chained hashes, from the first (empty if one was dropped)
    count: int

    @property
    def blocks(self) -> int:
        return len(self.tokens) // self.block_size


class HotPrefixes:
    """How many requests went through each block of their prompts (a tree of the block hashes,
    like the engine's radix cache, per cache namespace since the hashes are salted), so the
    prefixes requests share show as chains of blocks counted more than once. A shared prefix
    worth warming ends at a block most of whose requests went different ways after it (a
    tenant's system prompt, then each user's question): counted at least twice, and no block
    after it counted more than half as often. Bounded: `capacity` blocks, least recently seen
    dropped first (a prompt's first blocks are its most recent, so chains lose leaves first),
    `max_tokens` deep. Cost per request: a dict update per block."""

    def __init__(self, capacity: int = 65536, max_tokens: int = 4096, half_life: float = 600.0) -> None:
        self.capacity, self.max_tokens, self.half_life = capacity, max_tokens, half_life
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._block_size = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def observe(self, key: RoutingKey, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        depth = min(len(key.hashes), self.max_tokens // key.block_size, len(key.tokens) // key.block_size)
        self._block_size = key.block_size
        blocks, hashes, tokens, child = self._blocks, key.hashes, None, 0
        for index in range(depth - 1, -1, -1):   # last block first, so the first is the most recent
            digest = hashes[index]
            block = blocks.get(digest)
            if block is None:   # a prompt's new blocks are most of the cost: made in one go
                tokens = tokens or tuple(key.tokens[:depth * key.block_size])
                block = blocks[digest] = _Block(hashes[index - 1] if index else None, index + 1, tokens,
                                                key.model, key.salt, 1, child, 1.0, now)
            else:
                blocks.move_to_end(digest)
                block.count += 1
                block.score = block.score * 0.5 ** ((now - block.seen) / self.half_life) + 1.0
                block.seen = now
                if child > block.max_child:
                    block.max_child = child
            child = block.count
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def hottest(self, limit: int, now: float | None = None) -> list[HotPrefix]:
        """The `limit` shared prefixes requested most of late, hottest first."""
        now = time.monotonic() if now is None else now
        ends = [(digest, block) for digest, block in self._blocks.items()
                if block.count >= 2 and 2 * block.max_child <= block.count]
        scores = {digest: block.score * 0.5 ** ((now - block.seen) / self.half_life) for digest, block in ends}
        ends.sort(key=lambda item: (scores[item[0]], item[1].depth), reverse=True)
        chosen: dict[int, HotPrefix] = {}
        for digest, block in ends:   # a prefix warms its start too: a later, longer one replaces it
            if len(chosen) == limit:
                break
            prefix = self._prefix(digest, block)
            for start in prefix.hashes[:-1]:
                chosen.pop(start, None)
            chosen[digest] = prefix
        return [chosen[d] for d in sorted(chosen, key=lambda d: (scores[d], chosen[d].blocks), reverse=True)]

    def _prefix(self, digest: int, block: _Block) -> HotPrefix:
        chain = [digest]
        parent = block.parent
        while parent is not None:   # stops early where a block was dropped
            chain.append(parent)
            above = self._blocks.get(parent)
            parent = above.parent if above is not None else None
        chain.reverse()
        size = self._block_size
        hashes = tuple(chain) if len(chain) == block.depth else ()
        return HotPrefix(block.model, block.salt, size, block.tokens[:block.depth * size], hashes, block.count)


@dataclass(frozen=True)
class WarmupConfig:
    prefixes: int = 8          # hottest prefixes sent to a new replica (0: no warm-up)
    max_tokens: int = 16384    # prompt tokens sent to one new replica at most
    concurrency: int = 2       # warm-up requests in flight, all replicas together
    digest_wait: float = 5.0   # seconds to wait for the replica's digest, to skip what it holds


class Warmer:
    """Notices engines becoming Ready (`notice`, from the engines' poll loop) and warms each in
    a background task. `count(outcome, tokens)` is the router's metric: outcome `sent`,
    `cached` (the engine already held it) or `failed`. `headers`: the engines' API key."""

    def __init__(self, hot: HotPrefixes, views: EngineViews, client: httpx.AsyncClient,
                 config: WarmupConfig = WarmupConfig(), count: Callable[[str, int], None] = lambda o, t: None,
                 headers: dict[str, str] | None = None) -> None:
        self.hot, self.views, self.client, self.config = hot, views, client, config
        self.count, self.headers = count, headers or {}
        self._known: set[str] = set()
        self._slots = asyncio.Semaphore(max(1, config.concurrency))
        self._tasks: set[asyncio.Task] = set()

    def notice(self, urls: Sequence[str]) -> None:
        """`urls` are Ready now: warm those that were not at the last call."""
        new = [url for url in urls if url not in self._known]
        self._known = set(urls)
        if self.config.prefixes <= 0:
            return
        for url in new:
            prefixes = self.hot.hottest(self.config.prefixes)
            if prefixes:
                task = asyncio.create_task(self.warm(url, prefixes))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def warm(self, url: str, prefixes: Sequence[HotPrefix]) -> None:
        view = self.views.get(url)
        deadline = time.monotonic() + self.config.digest_wait
        while view.seq is None and time.monotonic() < deadline:   # its first /kv/blocks poll
            await asyncio.sleep(0.1)
        budget, sends = self.config.max_tokens, []
        for prefix in prefixes:
            blocks = min(prefix.blocks, budget // prefix.block_size)
            if blocks <= 0:
                break
            now = time.monotonic()
            held = view.matched_blocks(prefix.hashes[:blocks], now) if len(prefix.hashes) >= blocks else 0
            if held >= blocks:
                self.count("cached", 0)
                continue
            budget -= blocks * prefix.block_size
            sends.append(self._send(url, prefix, blocks))
        await asyncio.gather(*sends)

    async def _send(self, url: str, prefix: HotPrefix, blocks: int) -> None:
        prompt = list(prefix.tokens[:blocks * prefix.block_size])
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if prefix.model is not None:
            body["model"] = prefix.model
        if prefix.salt is not None:
            body["cache_salt"] = prefix.salt
        async with self._slots:
            try:
                response = await self.client.post(f"{url}/v1/completions", json=body, headers=self.headers,
                                                  timeout=300.0)
                response.raise_for_status()
            except httpx.HTTPError as error:
                log.warning("warm-up of %s (%d tokens) failed: %r", url, len(prompt), error)
                self.count("failed", 0)
                return
        self.count("sent", len(prompt))
        log.info("warmed %s with a %d-token prefix", url, len(prompt))
