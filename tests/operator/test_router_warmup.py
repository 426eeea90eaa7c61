"""Warm-up of engines that become Ready: the router records the block-aligned prefixes requests
share (per model and cache_salt), and sends a new engine the hottest few as prefill-only
completions with the same token ids, model and cache_salt, skipping what it already holds,
within the token budget and only once per engine becoming Ready."""

from __future__ import annotations

import asyncio
import json

import httpx

from kubeinfer.operator.gateway.engine_views import EngineViews
from kubeinfer.operator.gateway.routing_key import RoutingKey
from kubeinfer.operator.gateway.warmup import HotPrefixes, Warmer, WarmupConfig
from kubeinfer.server.engine.kv_events import HASH_SCHEME, block_hash, block_hashes, root_hash

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
    assert [(body["cache_salt"], body["prompt"]) for body in sent] == [("s3", system(3)), ("s1", system(1))]
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
