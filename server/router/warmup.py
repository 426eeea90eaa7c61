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
import random
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
    hold_seconds: float = 60.0   # a prefix's traffic waits for its warm-up this long at most


class Warmer:
    """Notices engines becoming Ready (`notice`, from the engines' poll loop) and warms each in
    a background task. `count(outcome, tokens)` is the router's metric: outcome `sent` (with
    the prompt tokens the engine prefilled for it), `cached` (the engine held it already) or
    `failed`. `headers`: the engines' API key.

    While a prefix is being warmed on a replica, its blocks are listed there as `warming`
    (`EngineView.warming`), so the prefix-aware picker holds that prefix's traffic off the
    replica (see `PrefixAware`); when the warm-up ends the blocks count as cached there.

    Several routers warm the same new replica each on its own (they do not talk), and warm-up
    stays idempotent at the engine: just before each send the router re-reads the engine's
    digest and skips a prefix it holds, and the engine publishes (and shares) a prompt's blocks
    when it schedules them, so a second router's copy of a warm-up sent meanwhile finds the
    first's blocks and prefills only the last block. Each router sends its share in its own
    rotated order, so two routers rarely start on the same prefix at once. The engine's
    `cached_tokens` for each warm-up say which router did the work: a copy counts `cached`.
    """

    def __init__(self, hot: HotPrefixes, views: EngineViews, client: httpx.AsyncClient,
                 config: WarmupConfig = WarmupConfig(), count: Callable[[str, int], None] = lambda o, t: None,
                 headers: dict[str, str] | None = None, rng: random.Random | None = None) -> None:
        self.hot, self.views, self.client, self.config = hot, views, client, config
        self.count, self.headers = count, headers or {}
        self.rng = rng or random.Random()
        self._known: set[str] = set()
        self._slots = asyncio.Semaphore(max(1, config.concurrency))
        self._tasks: set[asyncio.Task] = set()
        self._holding: dict[str, list[tuple[int, ...]]] = {}   # url -> hashes of its warm-ups in flight

    def notice(self, urls: Sequence[str]) -> None:
        """`urls` are Ready now: warm those that were not at the last call. The hold on their
        hot prefixes starts here, before the first request can be routed to them."""
        new = [url for url in urls if url not in self._known]
        self._known = set(urls)
        if self.config.prefixes <= 0:
            return
        for url in new:
            prefixes = self.hot.hottest(self.config.prefixes)
            if prefixes:
                for prefix, blocks in self._plan(prefixes):
                    self._hold(url, prefix.hashes[:blocks])
                task = asyncio.create_task(self.warm(url, prefixes))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _plan(self, prefixes: Sequence[HotPrefix]) -> list[tuple[HotPrefix, int]]:
        """(prefix, whole blocks to send) within the token budget, hottest first."""
        budget, plan = self.config.max_tokens, []
        for prefix in prefixes:
            blocks = min(prefix.blocks, budget // prefix.block_size)
            if blocks <= 0:
                break
            budget -= blocks * prefix.block_size
            plan.append((prefix, blocks))
        return plan

    def _hold(self, url: str, hashes: tuple[int, ...]) -> None:
        if not hashes or self.config.hold_seconds <= 0:
            return
        until = time.monotonic() + self.config.hold_seconds
        self._holding.setdefault(url, []).append(hashes)
        self.views.get(url).warming.update(dict.fromkeys(hashes, until))

    def _release(self, url: str, hashes: tuple[int, ...]) -> None:
        """End the hold of one warm-up (blocks another warm-up in flight also brings stay held)."""
        holding = self._holding.get(url)
        if not hashes or not holding or hashes not in holding:
            return
        holding.remove(hashes)
        still = {block for other in holding for block in other}
        warming = self.views.get(url).warming
        for block in hashes:
            if block not in still:
                warming.pop(block, None)
        if not holding:
            del self._holding[url]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def warm(self, url: str, prefixes: Sequence[HotPrefix]) -> None:
        """Send `url` those of `prefixes` it does not hold, within the token budget (`notice`
        put the hold on them all)."""
        view = self.views.get(url)
        held = self._plan(prefixes)
        try:
            deadline = time.monotonic() + self.config.digest_wait
            while view.seq is None and time.monotonic() < deadline:   # its first /kv/blocks poll
                await asyncio.sleep(0.1)
            missing = []
            for prefix in prefixes:
                if self._held(url, prefix, prefix.blocks):
                    self.count("cached", 0)
                else:
                    missing.append(prefix)
            plan = self._plan(missing)
            for prefix, blocks in plan:   # what the budget left to the prefixes held already
                if (prefix, blocks) not in held:
                    self._hold(url, prefix.hashes[:blocks])
                    held.append((prefix, blocks))
            for prefix, blocks in held:
                if (prefix, blocks) not in plan:
                    self._release(url, prefix.hashes[:blocks])
            if len(plan) > 1:   # each router its own order (see the class)
                turn = self.rng.randrange(len(plan))
                plan = [*plan[turn:], *plan[:turn]]
            await asyncio.gather(*(self._send(url, prefix, blocks) for prefix, blocks in plan))
        finally:
            for prefix, blocks in held:
                self._release(url, prefix.hashes[:blocks])

    def _held(self, url: str, prefix: HotPrefix, blocks: int) -> bool:
        hashes = prefix.hashes[:blocks]
        return len(hashes) == blocks and self.views.get(url).matched_blocks(hashes, time.monotonic()) >= blocks

    async def _send(self, url: str, prefix: HotPrefix, blocks: int) -> None:
        prompt = list(prefix.tokens[:blocks * prefix.block_size])
        hashes = prefix.hashes[:blocks]
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if prefix.model is not None:
            body["model"] = prefix.model
        if prefix.salt is not None:
            body["cache_salt"] = prefix.salt
        async with self._slots:
            if not self._held(url, prefix, blocks) and len(hashes) == blocks:
                try:   # what the engine holds now: another router may have warmed it meanwhile
                    await self.views.read_digest(self.views.get(url))
                except (httpx.HTTPError, ValueError, KeyError) as error:
                    log.debug("no digest from %s before a warm-up: %r", url, error)
            if self._held(url, prefix, blocks):
                self.count("cached", 0)
                return
            try:
                response = await self.client.post(f"{url}/v1/completions", json=body, headers=self.headers,
                                                  timeout=300.0)
                response.raise_for_status()
                usage = response.json().get("usage") or {}
            except (httpx.HTTPError, ValueError) as error:
                log.warning("warm-up of %s (%d tokens) failed: %r", url, len(prompt), error)
                self.count("failed", 0)
                return
        if hashes:   # cached there now: counted so until the engine's digest shows the blocks
            self.views.sent(url, hashes)
            self.views.ended(url, hashes)
        self._release(url, hashes)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if cached + prefix.block_size >= len(prompt) > prefix.block_size:   # all but the last block was there
            self.count("cached", len(prompt) - cached)
        else:
            self.count("sent", len(prompt) - cached)
        log.info("warmed %s with a %d-token prefix (%d found cached)", url, len(prompt), cached)
