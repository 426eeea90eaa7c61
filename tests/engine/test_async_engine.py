"""AsyncEngine: streaming from the loop thread, validation before the first output,
and consumer cancellation aborting the request and freeing its blocks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kubeinfer.server.engine.async_engine import AsyncEngine, EngineDeadError
from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.llm_engine import LLMEngine
from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture
async def engine(tiny_qwen2):
    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory=4 << 20), tiny_qwen2[0]))
    yield engine
    await engine.shutdown()


async def _wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("engine did not go idle")


async def test_streams_deltas_that_add_up(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = [o async for o in engine.generate("r1", [5, 6, 7, 8], params)]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    final = outputs[-1].outputs[0]
    assert sum((o.outputs[0].delta_token_ids for o in outputs), []) == final.token_ids
    assert "".join(o.outputs[0].delta_text for o in outputs) == final.text
    assert len(final.token_ids) == 12 and final.finish_reason == "length"
    metrics = outputs[-1].metrics
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time
    assert engine.is_alive() and engine.num_unfinished_requests == 0


async def test_concurrent_requests_run_together(engine):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run(i: int) -> list[int]:
        return [o async for o in engine.generate(f"c{i}", [5 + i] * (3 + i), params)][-1] \
            .outputs[0].token_ids

    results = await asyncio.gather(*(run(i) for i in range(6)))
    assert all(len(tokens) == 8 for tokens in results)
    assert engine.stats().generation_tokens == 48


async def test_invalid_request_raises_before_any_output(engine):
    with pytest.raises(InvalidRequestError, match="temperature"):
        async for _ in engine.generate("bad", [5, 6], SamplingParams(temperature=-1)):
            pass
    assert engine.num_unfinished_requests == 0


async def test_consumer_leaving_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    stream = engine.generate("long", [5] * 40, params)
    async for _ in stream:
        break
    await stream.aclose()
    await _wait_idle(engine)
    stats = engine.stats()
    cached = engine.engine.kv.cache.num_cached_blocks
    assert stats.num_blocks_free == stats.num_blocks_total - cached
    assert engine.num_unfinished_requests == 0


async def test_abort_ends_the_stream_with_abort(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    outputs = []
    async for output in engine.generate("a", [5] * 10, params):
        outputs.append(output)
        if len(outputs) == 2:
            engine.abort("a")
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    await _wait_idle(engine)
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total - \
        engine.engine.kv.cache.num_cached_blocks


async def test_shutdown_ends_open_streams_with_abort(tiny_qwen2):
    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory=4 << 20), tiny_qwen2[0]))
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    stream = engine.generate("s", [5] * 10, params)
    first = await anext(stream)
    await engine.shutdown()
    rest = [o async for o in stream]
    assert not first.finished and rest[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_alive()


async def test_generate_after_shutdown_fails_at_once(tiny_qwen2):
    engine = AsyncEngine(LLMEngine(EngineConfig(kv_cache_memory=4 << 20), tiny_qwen2[0]))
    await engine.shutdown()
    stream = engine.generate("late", [5] * 4, SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(anext(stream), timeout=5)
    assert engine.num_unfinished_requests == 0


async def test_builds_and_steps_on_one_thread(tiny_qwen2):
    """Torch work must stay on one thread (a second OpenMP team slows each step 2-3x)."""
    threads = []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        return LLMEngine(EngineConfig(kv_cache_memory=4 << 20), tiny_qwen2[0])

    engine = AsyncEngine(build)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outputs = [o async for o in engine.generate("t", [5, 6, 7], params)]
        assert len(outputs[-1].outputs[0].token_ids) == 3
        assert threads == [engine._thread]
    finally:
        await engine.shutdown()


def test_a_failed_build_raises_from_the_constructor():
    def build() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
