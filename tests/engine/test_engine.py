"""Engine behaviour on a tiny random Qwen2: prefix cache, rejections, abort, preemption, n>1,
stop conditions and logprobs."""

from __future__ import annotations

import time

import pytest

from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_shared_prefix_is_prefilled_once_and_changes_nothing(make_llm, random_prompts):
    prefix = random_prompts(1, 512, 512, seed=7)[0]
    prompts = [prefix + suffix for suffix in random_prompts(32, 8, 24, seed=8)]
    cached = make_llm(enable_prefix_caching=True)
    started = time.time()
    with_cache = cached.generate(prompts, GREEDY)
    uncached = make_llm(enable_prefix_caching=False)
    without_cache = uncached.generate(prompts, GREEDY)
    assert _tokens(with_cache) == _tokens(without_cache)
    assert with_cache[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 512 for o in with_cache[1:])
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits == 31 * 512
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    recent = stats.recent_prefix_cache_hits   # the same hits, decaying (deletion cost), settled next tick
    oldest = time.time() + recent.tick - started
    assert 31 * 512 * 0.5 ** (oldest / recent.half_life) <= recent.value(time.time() + recent.tick) <= 31 * 512
    assert uncached.engine.stats().prefix_cache_hits == 0
    assert stats.num_blocks_free == stats.num_blocks_total - cached.engine.kv.cache.num_cached_blocks
    assert stats.kv_cache_usage == 0.0



def test_a_failed_step_leaves_no_uncomputed_block_in_the_prefix_cache(make_llm, random_prompts, monkeypatch):
    """Blocks enter the prefix cache when scheduled; a forward pass that fails never computed
    them, so a later request must not share them."""
    llm = make_llm(enable_prefix_caching=True)
    prompt = random_prompts(1, 64, 64, seed=3)[0]

    def fail(out: object) -> None:
        raise RuntimeError("forward failed")

    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "run", fail)
        llm.engine.add_request("doomed", prompt, GREEDY)
        with pytest.raises(RuntimeError, match="forward failed"):
            llm.engine.step()
    assert llm.engine.kv.cache.num_cached_blocks == 0
    llm.engine.abort_request("doomed")
    [again] = llm.generate([prompt], GREEDY)
    assert again.num_cached_tokens == 0
    [fresh] = make_llm(enable_prefix_caching=False).generate([prompt], GREEDY)
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids

def test_cache_salt_keeps_tenants_apart(make_llm, random_prompts):
    prompt = random_prompts(1, 64, 64, seed=3)[0]
    llm = make_llm()
    llm.generate([prompt], SamplingParams(max_tokens=1, cache_salt="a"))
    other, same = llm.generate([prompt, prompt], [SamplingParams(max_tokens=1, cache_salt="b"),
                                                  SamplingParams(max_tokens=1, cache_salt="a")])
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 48


@pytest.mark.parametrize("params, prompt_len, message", [
    (SamplingParams(), 4096, "maximum context length is 4096"),
    (SamplingParams(max_tokens=4000), 200, "requested 4200 tokens (200 in the prompt, 4000 in the completion)"),
    (SamplingParams(stop_token_ids=[100000]), 5, "stop_token_ids contains 100000"),
    (SamplingParams(n=0), 5, "n must be at least 1"),
    (SamplingParams(temperature=-0.5), 5, "temperature must be non-negative"),
    (SamplingParams(top_p=0.0), 5, "top_p must be in (0, 1]"),
    (SamplingParams(top_p=1.5), 5, "top_p must be in (0, 1]"),
    (SamplingParams(top_k=-2), 5, "top_k must be -1"),
    (SamplingParams(min_tokens=20, max_tokens=10), 5, "min_tokens (20) must be less"),
    (SamplingParams(logprobs=50), 5, "logprobs must be in [0, 20]"),
    (SamplingParams(seed=2**64), 5, "seed must be in [-9223372036854775808, 9223372036854775807]"),
    (SamplingParams(temperature=float("nan")), 5, "temperature must be a finite number"),
    (SamplingParams(repetition_penalty=float("inf")), 5, "repetition_penalty must be a finite number"),
])
def test_bad_requests_are_rejected_clearly_and_leak_nothing(make_llm, params, prompt_len,
                                                            message):
    llm = make_llm()
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5] * prompt_len], params)
    assert message in str(error.value)
    stats = llm.engine.stats()
    assert stats.num_waiting == stats.num_running == 0
    assert stats.num_blocks_free == stats.num_blocks_total
    assert not llm.engine.has_unfinished_requests()


def test_out_of_vocabulary_prompt_is_rejected(make_llm):
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        make_llm().generate([[1, 2, 10**6]], GREEDY)


def test_abort_frees_blocks_at_once(make_llm, random_prompts):
    llm = make_llm(enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("a", random_prompts(1, 100, 100)[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.stats().num_blocks_free < engine.stats().num_blocks_total
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == 0


def test_preemption_under_a_tiny_pool_keeps_greedy_outputs(make_llm, random_prompts):
    prompts = random_prompts(8, 20, 60, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = make_llm().generate(prompts, params)
    # 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 (k, v) x 16 tokens = 8 KiB per block: 24 blocks
    tiny = make_llm(kv_cache_memory=24 * 8192)
    squeezed = tiny.generate(prompts, params)
    assert tiny.engine.stats().num_preemptions > 0
    assert _tokens(squeezed) == _tokens(roomy)


def test_n_completions_with_a_seed_are_reproducible_and_share_the_prompt(make_llm,
                                                                         random_prompts):
    prompt = random_prompts(1, 70, 70, seed=5)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    llm = make_llm(enable_prefix_caching=False)
    first = llm.generate([prompt], params)[0]
    second = make_llm().generate([prompt], params)[0]
    assert _tokens([first]) == _tokens([second])
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    stats = llm.engine.stats()
    assert stats.prompt_tokens == 70 and stats.generation_tokens == 4 * 12


def test_stop_string_cuts_the_text_without_leaking(make_llm, random_prompts):
    llm = make_llm()
    prompt = random_prompts(1, 10, 10, seed=6)[0]
    text = llm.generate([prompt], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    engine = llm.engine
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta_text)
            final = output.outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:text.index(stop)] == "".join(deltas)


def test_stop_token_and_min_tokens(make_llm, random_prompts):
    llm = make_llm()
    prompt = random_prompts(1, 10, 10, seed=9)[0]
    tokens = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_id = tokens[2]
    early = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    assert early.finish_reason == "stop" and early.stop_reason == stop_id
    assert early.token_ids == tokens[:tokens.index(stop_id) + 1]
    late = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8,
                                                 stop_token_ids=[stop_id]))[0].outputs[0]
    assert len(late.token_ids) >= 8 and stop_id not in late.token_ids[:7]


def test_logprobs_have_one_entry_per_token_with_the_sampled_one(make_llm, random_prompts):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, logprobs=3, ignore_eos=True)
    out = make_llm().generate(random_prompts(1, 12, 12), params)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert sorted(lp.rank for t, lp in entry.items() if t != token or lp.rank <= 3)[:3] == [
            1, 2, 3]
        assert all(lp.logprob <= 0.0 for lp in entry.values())


def test_generation_defaults_apply_only_to_unset_fields(make_llm, random_prompts):
    llm = make_llm()
    llm.engine.generation_defaults = {"temperature": 0.0, "top_k": 5}
    request = llm.engine.make_request("x", [5, 6], SamplingParams(top_k=2))
    assert request.params.temperature == 0.0 and request.params.top_k == 2


def test_default_max_tokens_is_clamped_to_the_context(make_llm):
    llm = make_llm(max_model_len=64)
    llm.engine.generation_defaults = {"max_tokens": 1000}
    assert llm.engine.make_request("d", [5] * 40, SamplingParams()).params.max_tokens == 24
    with pytest.raises(InvalidRequestError, match="1000 in the completion") as error:
        llm.engine.make_request("e", [5] * 40, SamplingParams(max_tokens=1000))
    assert error.value.param == "max_tokens" and error.value.code == "context_length_exceeded"


def test_a_detokenizer_fault_fails_its_request_alone_and_frees_its_blocks(make_llm, random_prompts, monkeypatch):
    from kubeinfer.server.engine.detokenizer import IncrementalDetokenizer

    prompts = random_prompts(4, 20, 40, seed=3)
    clean = make_llm().generate(prompts, GREEDY)
    original = IncrementalDetokenizer.add_token

    def add_token(self, token_id, check_stop=True):
        if self.ids[:len(prompts[2][-6:])] == prompts[2][-6:] and len(self.ids) > 8:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, token_id, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    llm = make_llm()
    outputs = llm.generate(prompts, GREEDY)
    assert outputs[2].error and "UnicodeDecodeError" in outputs[2].error and outputs[2].finished
    assert outputs[2].outputs[0].finish_reason == "error"
    for i in (0, 1, 3):
        assert outputs[i].error is None and outputs[i].outputs[0].token_ids == clean[i].outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total
