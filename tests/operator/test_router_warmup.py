"""Warm-up of engines that become Ready: the router records the block-aligned prefixes requests
share (per model and cache_salt), and sends a new engine the hottest few as prefill-only
completions with the same token ids, model and cache_salt, skipping what it already holds,
within the token budget and only once per engine becoming Ready."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from kubeinfer.server.router.engine_views import EngineViews
from kubeinfer.server.router.routing_key import RoutingKey
from kubeinfer.server.router.warmup import HotPrefixes, Warmer, WarmupConfig
from kubeinfer.server.engine.kv_events import HASH_SCHEME, block_hash, block_hashes, root_hash

pytestmark = pytest.mark.unit

BS = 16


def system(tenant: int, blocks: int = 4) -> list[int]:
    return [10_000 * (tenant + 1) + i for i in range(blocks * BS)]


def key(tokens: list[int], salt: str | None = None, model: str | None = "m") -> RoutingKey:
    """As the router's KeyMaker makes it (affinity: the first 32 tokens)."""
    return RoutingKey(len(tokens), BS, tuple(block_hashes(tokens[:-1], BS, salt)),
                      block_hash(root_hash(salt), tokens[:32]), model=model, salt=salt, tokens=tokens)


def question(tenant: int, q: int, salt: str | None = None, blocks: int = 4) -> RoutingKey:
    return key(system(tenant, blocks) + [500 + q] * (BS + 3 + q), salt)


def test_the_shared_system_prompt_is_recorded_and_single_prompts_are_not_hot() -> None:
    hot = HotPrefixes()
    for q in range(3):
        hot.observe(question(0, q), now=float(q))
    hot.observe(question(1, 0), now=3.0)            # seen once: nothing shows it is shared
    [entry] = hot.hottest(8, now=4.0)
    assert (entry.model, entry.salt, entry.count, entry.blocks) == ("m", None, 3, 4)
    assert list(entry.tokens) == system(0) and entry.hashes == question(0, 0).hashes[:4]


def test_a_short_prompt_and_a_shared_start_of_different_tenants() -> None:
    """Tenants whose prompts begin alike are told apart where they part; a prompt shorter than
    the routing key's affinity span still counts."""
    hot = HotPrefixes()
    common = list(range(2 * BS))
    for tenant in range(2):
        for q in range(3):
            hot.observe(key(common + system(tenant, 2) + [700 + q] * (BS + 1)))
    short = [key(system(5, 1) + [800 + q] * 3) for q in range(2)]
    for request in short:
        hot.observe(request)
    found = sorted((e.count, len(e.tokens), max(e.tokens)) for e in hot.hottest(8))
    assert found == [(2, BS, 60_015), (3, 4 * BS, 10_031), (3, 4 * BS, 20_031)]   # not the 2 common blocks alone


def test_salts_are_separate_namespaces_and_hotter_comes_first() -> None:
    hot = HotPrefixes()
    for q in range(2):
        hot.observe(question(0, q, salt="a"), now=0.0)
    for q in range(4):
        hot.observe(question(0, q, salt="b"), now=0.0)
    found = [(e.salt, e.model, e.count, list(e.tokens)) for e in hot.hottest(8, now=1.0)]
    assert found == [("b", "m", 4, system(0)), ("a", "m", 2, system(0))]


def test_recent_requests_outrank_old_ones() -> None:
    hot = HotPrefixes(half_life=60.0)
    for q in range(4):
        hot.observe(question(0, q), now=0.0)    # 4 requests ten minutes ago
    for q in range(2):
        hot.observe(question(1, q), now=600.0)  # 2 now
    assert [list(e.tokens) for e in hot.hottest(2, now=600.0)] == [system(1), system(0)]


def test_the_record_is_bounded_in_blocks_and_tokens() -> None:
    hot = HotPrefixes(capacity=10, max_tokens=2 * BS)
    for tenant in range(6):
        for q in range(2):
            hot.observe(question(tenant, q), now=0.0)
    entries = hot.hottest(10, now=0.0)
    assert len(hot) == 10 and len(entries) == 5
    assert {e.tokens[0] for e in entries} == {10_000 * (t + 1) for t in range(1, 6)}   # oldest dropped
    assert all(len(e.tokens) == 2 * BS for e in entries)


def _engine(sent: list[dict], cached_tokens: list[int] | None = None):
    """A mock engine: records the completion bodies, publishes `cached_tokens`' blocks."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/kv/blocks":
            return httpx.Response(200, json={"hash": HASH_SCHEME, "block_size": BS, "epoch": "e", "seq": 1,
                                             "reset": True, "stored": block_hashes(cached_tokens or [], BS),
                                             "removed": []})
        if request.url.path == "/v1/completions":
            sent.append({**json.loads(request.content), "authorization": request.headers.get("authorization")})
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        return httpx.Response(200, text="")
    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def test_a_new_engine_gets_the_hottest_prefixes_once_skipping_what_it_holds() -> None:
    sent: list[dict] = []
    counts: list[tuple[str, int]] = []

    async def scenario() -> None:
        client = _engine(sent, cached_tokens=system(2))      # the new engine holds tenant 2 already
        hot = HotPrefixes()
        views = EngineViews(client)
        warmer = Warmer(hot, views, client, WarmupConfig(prefixes=3, max_tokens=8 * BS),
                        lambda outcome, tokens: counts.append((outcome, tokens)), {"Authorization": "Bearer k"})
        warmer.notice(["http://old"])                        # Ready at the router's start: nothing known
        for tenant in range(4):
            for q in range(tenant + 2):                      # tenant 3 hottest
                hot.observe(question(tenant, q, salt=None if tenant == 2 else f"s{tenant}"))
        await views.refresh(["http://old", "http://new"])
        warmer.notice(["http://old", "http://new"])
        warmer.notice(["http://old", "http://new"])          # still Ready: not warmed twice
        await asyncio.gather(*warmer._tasks)
        await client.aclose()

    asyncio.run(scenario())
    # hottest 3: tenants 3, 2 (held: skipped), 1, within the budget of 8 blocks; only the new engine
    assert sorted((body["cache_salt"], body["prompt"]) for body in sent) == [("s1", system(1)), ("s3", system(3))]
    assert all(body["max_tokens"] == 1 and body["model"] == "m" and body["authorization"] == "Bearer k"
               for body in sent)
    assert sorted(counts) == [("cached", 0), ("sent", 4 * BS), ("sent", 4 * BS)]


def test_the_token_budget_trims_to_whole_blocks() -> None:
    sent: list[dict] = []

    async def scenario() -> None:
        client = _engine(sent)
        hot = HotPrefixes()
        for tenant in range(2):
            for q in range(2):
                hot.observe(question(tenant, q, blocks=6))
        warmer = Warmer(hot, EngineViews(client), client, WarmupConfig(prefixes=8, max_tokens=8 * BS, digest_wait=0))
        warmer.notice(["http://new"])
        await asyncio.gather(*warmer._tasks)
        await client.aclose()

    asyncio.run(scenario())
    assert sorted(len(body["prompt"]) for body in sent) == [2 * BS, 6 * BS]


def test_no_warmup_without_shared_prefixes_or_when_turned_off() -> None:
    sent: list[dict] = []

    async def scenario() -> None:
        client = _engine(sent)
        hot = HotPrefixes()
        hot.observe(question(0, 0))
        Warmer(hot, EngineViews(client), client).notice(["http://new"])
        hot.observe(question(0, 1))
        off = Warmer(hot, EngineViews(client), client, WarmupConfig(prefixes=0))
        off.notice(["http://new"])
        assert not off._tasks
        await asyncio.sleep(0.05)
        await client.aclose()

    asyncio.run(scenario())
    assert sent == []


class _Engine:
    """A mock engine with the real one's cache behaviour as the router sees it: a completion's
    full prompt blocks are published in /kv/blocks (`seq` grows) as it is admitted, and a later
    prompt's blocks found there are reported in `usage.prompt_tokens_details.cached_tokens`
    (all but the last token's block, as the engine matches). `fail`: answer 500 instead."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.bodies, self.stored, self.seq = fail, [], [], 0
        self.prefilled = 0   # prompt tokens computed
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/kv/blocks":
            return httpx.Response(200, json={"hash": HASH_SCHEME, "block_size": BS, "epoch": "e", "seq": self.seq,
                                             "reset": True, "stored": list(self.stored), "removed": []})
        if request.url.path == "/v1/completions":
            body = json.loads(request.content)
            self.bodies.append(body)
            if self.fail:
                return httpx.Response(500, json={"error": {"message": "boom"}})
            prompt = body["prompt"]
            hashes = block_hashes(prompt, BS, body.get("cache_salt"))
            cached = 0
            for digest in block_hashes(prompt[:-1], BS, body.get("cache_salt")):
                if digest not in self.stored:
                    break
                cached += BS
            self.prefilled += len(prompt) - cached
            self.stored += [h for h in hashes if h not in self.stored]
            self.seq += 1
            return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {
                "prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": cached}}})
        return httpx.Response(200, text="")


def _hot(tenants: int = 3) -> HotPrefixes:
    hot = HotPrefixes()
    for tenant in range(tenants):
        for q in range(2):
            hot.observe(question(tenant, q, salt=f"s{tenant}"))
    return hot


def test_the_hold_starts_when_the_engine_is_noticed_and_ends_with_each_warm_up() -> None:
    """From `notice` on, the new engine lists the blocks being warmed (the picker holds their
    traffic off it); once a warm-up is answered they count as cached there and the hold ends."""
    engine = _Engine()
    seen: list[int] = []

    async def scenario() -> None:
        views = EngineViews(engine.client)
        warmer = Warmer(_hot(), views, engine.client, WarmupConfig(prefixes=3, digest_wait=0))
        warmer.notice(["http://new"])
        view = views.get("http://new")
        for tenant in range(3):
            hashes = question(tenant, 9, salt=f"s{tenant}").hashes
            seen.append(view.warming_blocks(hashes, time.monotonic()) - view.matched_blocks(hashes, time.monotonic()))
        await asyncio.gather(*warmer._tasks)
        assert view.warming == {}
        for tenant in range(3):   # cached there now, before the engine's digest is polled again
            assert view.matched_blocks(question(tenant, 9, salt=f"s{tenant}").hashes, time.monotonic()) == 4
        await engine.client.aclose()

    asyncio.run(scenario())
    assert seen == [4, 4, 4]
    assert len(engine.bodies) == 3


def test_a_failed_warm_up_or_its_hold_time_ends_the_hold() -> None:
    engine = _Engine(fail=True)

    async def scenario() -> None:
        views = EngineViews(engine.client)
        warmer = Warmer(_hot(1), views, engine.client, WarmupConfig(prefixes=3, digest_wait=0))
        warmer.notice(["http://new"])
        assert views.get("http://new").warming
        await asyncio.gather(*warmer._tasks)
        assert views.get("http://new").warming == {}   # failed: traffic may go there, cold

        quick = Warmer(_hot(1), views, engine.client, WarmupConfig(prefixes=3, hold_seconds=0.01))
        quick.notice(["http://other"])
        hashes = question(0, 9, salt="s0").hashes
        await asyncio.sleep(0.05)   # the warm-up is still waiting for a digest; its hold is over
        assert views.get("http://other").warming_blocks(hashes, time.monotonic()) == 0
        await quick.stop()
        await engine.client.aclose()

    asyncio.run(scenario())


def test_two_routers_warming_one_new_engine_prefill_each_prefix_once() -> None:
    """Two routers (two Warmers, same hot prefixes, no shared state) notice the same new engine
    at once. Whichever reaches a prefix second finds it in the engine's digest and skips it, or
    (sent meanwhile) finds all but its last block cached: the engine prefills each prefix's
    blocks once, and the routers' counts say so (each prefix `sent` once between the two)."""
    engine = _Engine()
    counts: list[tuple[str, int]] = []

    async def scenario() -> None:
        routers = [Warmer(_hot(4), EngineViews(engine.client), engine.client,
                          WarmupConfig(prefixes=4, digest_wait=0, concurrency=2),
                          lambda outcome, tokens: counts.append((outcome, tokens)), rng=random.Random(seed))
                   for seed in (1, 2)]
        for warmer in routers:
            warmer.notice(["http://new"])
        await asyncio.gather(*(task for warmer in routers for task in warmer._tasks))
        await engine.client.aclose()

    asyncio.run(scenario())
    sent = [tokens for outcome, tokens in counts if outcome == "sent"]
    assert sorted(outcome for outcome, _ in counts) == ["cached"] * 4 + ["sent"] * 4
    assert sum(sent) == 4 * 4 * BS
    # each prefix's blocks computed once; a copy sent before the first was published costs its last block
    copies = len(engine.bodies) - 4
    assert engine.prefilled == 4 * 4 * BS + copies * BS


def test_a_router_that_comes_second_sends_nothing() -> None:
    engine = _Engine()

    async def scenario() -> None:
        for seed in (1, 2):
            warmer = Warmer(_hot(3), EngineViews(engine.client), engine.client,
                            WarmupConfig(prefixes=3, digest_wait=0), rng=random.Random(seed))
            warmer.notice(["http://new"])
            await asyncio.gather(*warmer._tasks)
        await engine.client.aclose()

    asyncio.run(scenario())
    assert len(engine.bodies) == 3 and engine.prefilled == 3 * 4 * BS
