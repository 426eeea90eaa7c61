"""Speculative decoding end to end on the tiny Qwen2 engine: every proposer leaves greedy output
token for token what it is without speculation (logprobs, stop strings, max_tokens, prefix-cache
hits, preemption and chunked prefill in the same batch included), gives back every KV block
(after aborts too), counts vLLM's spec-decode metrics, and the adaptive rules stop drafting where
it does not pay. The proposers' own logic is tested in test_spec_proposers.py."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.engine_runs import run_requests
from helpers.tiny_models import build_tiny_qwen2

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Sequence
from kubeinfer.server.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

pytestmark = pytest.mark.integration

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
METHODS = ("ngram", "suffix", "draft_model")
GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4   # K and V, 2 layers, 4 tokens, 2 KV heads of 16, float32


@pytest.fixture(scope="module")
def draft_model_path(tmp_path_factory) -> str:
    """The tiny Qwen2's weights plus noise, with its tokenizer: a draft model that agrees with
    the target on most greedy tokens but not all (so drafts are rejected too)."""
    path, model = build_tiny_qwen2(tmp_path_factory.mktemp("draft"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture
def spec_config(draft_model_path):
    """spec_config(method) -> the --speculative-config of that proposer, 4 tokens."""
    def make(method: str) -> dict:
        if method == "ngram":
            return NGRAM
        if method == "suffix":
            return {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0}
        return {"model": draft_model_path, "num_speculative_tokens": 4}
    return make


def _repetitive_prompts(random_prompts, count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram and suffix proposers then find matches) with a
    random tail; the tiny model's own loops give matches in the output too."""
    phrases = random_prompts(count, 4, 10, seed=seed)
    tails = random_prompts(count, 1, 8, seed=seed + 1)
    return [phrase * 3 + tail for phrase, tail in zip(phrases, tails)]


def _no_leaks(engine) -> None:
    kv = engine.kv
    cached = kv.cache.num_cached_blocks if kv.cache else 0
    assert kv.num_used_blocks == 0 and kv.pool.num_free == kv.pool.num_blocks - cached
    assert kv.pool.ref_counts.count(0) == kv.pool.num_free
    assert engine.stats().kv_cache_usage == 0.0
    draft_kv = getattr(engine.proposer, "kv", None)   # a draft model's own cache
    if draft_kv is not None:
        assert draft_kv.num_used_blocks == 0 and draft_kv.pool.num_free == draft_kv.pool.num_blocks


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _accepted(engine) -> int:
    return engine.stats().spec_decode.num_accepted_tokens


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_and_logprobs_are_unchanged(method, spec_config, make_llm, random_prompts):
    prompts = _repetitive_prompts(random_prompts, 6, seed=3)
    params = [SamplingParams(**GREEDY, max_tokens=n, logprobs=2) for n in (1, 2, 7, 24, 33, 40)]
    reference = make_llm(block_size=4).generate(prompts, params)
    llm = make_llm(block_size=4, speculative_config=spec_config(method))
    outputs = llm.generate(prompts, params)
    assert _token_ids(outputs) == _token_ids(reference)
    assert [len(t) for t in _token_ids(outputs)] == [1, 2, 7, 24, 33, 40]   # max_tokens exact
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    for ours, theirs in zip(outputs, reference):
        for mine, ref in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert mine.keys() == ref.keys()
            assert all(abs(mine[t].logprob - ref[t].logprob) < 1e-4 and mine[t].rank == ref[t].rank for t in mine)
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens   # kept and rejected
    assert stats.num_steps < llm.engine.counters.generation_tokens
    _no_leaks(llm.engine)


def test_a_bounded_suffix_trie_keeps_a_long_generation_unchanged(make_llm, random_prompts):
    """suffix_decoding_max_request_tokens far below the prompt and output lengths: every
    sequence's own trie stays within window x depth nodes at every step, and greedy output is
    still the non-speculative engine's."""
    config = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0,
              "suffix_decoding_max_tree_depth": 4, "suffix_decoding_max_request_tokens": 16}
    prompts = [prompt * 2 for prompt in _repetitive_prompts(random_prompts, 3, seed=13)]
    params = SamplingParams(**GREEDY, max_tokens=120)
    want = make_llm().generate(prompts, params)
    llm = make_llm(speculative_config=config)
    proposer, nodes = llm.engine.proposer, []
    original = proposer.propose

    def propose(seq, max_tokens):
        drafts = original(seq, max_tokens)
        nodes.append(proposer._states[id(seq)].own.num_nodes)
        return drafts
    proposer.propose = propose
    got = llm.generate(prompts, params)
    assert _token_ids(got) == _token_ids(want)
    assert nodes and max(nodes) <= 16 * 4 and _accepted(llm.engine) > 0
    assert all(len(p) > 16 for p in prompts)
    _no_leaks(llm.engine)


@pytest.mark.parametrize("method", METHODS)
def test_stop_strings_and_stop_tokens_end_where_they_would(method, spec_config, make_llm, random_prompts):
    prompts = _repetitive_prompts(random_prompts, 4, seed=5)
    plain = make_llm().generate(prompts, SamplingParams(**GREEDY, max_tokens=32))
    tokenizer = make_llm().tokenizer
    # a stop string from the middle of each answer's text, and a stop token from the second one
    stops = []
    for output in plain:
        text = output.outputs[0].text
        stops.append(text[len(text) // 2:len(text) // 2 + 3] if len(text) > 8 else "@@")
    stop_token = plain[1].outputs[0].token_ids[9]
    params = [SamplingParams(temperature=0.0, max_tokens=32, stop=[stop], stop_token_ids=[stop_token])
              for stop in stops]
    reference = make_llm().generate(prompts, params)
    llm = make_llm(speculative_config=spec_config(method))
    outputs = llm.generate(prompts, params)
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outputs] == [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                   o.outputs[0].stop_reason) for o in reference]
    assert any(o.outputs[0].finish_reason == "stop" for o in reference) and tokenizer is not None
    _no_leaks(llm.engine)


def _run_staggered(llm, prompts, params, arrivals: dict[int, int], abort_at: dict[int, int] | None = None) -> dict:
    """Add prompt i before step `arrivals[i]` (so new prefills join running decodes), abort
    prompt i at step `abort_at[i]`; returns the final output of every request by id."""
    engine, done, step = llm.engine, {}, 0
    pending = dict(enumerate(prompts))
    abort_at = abort_at or {}
    while pending or engine.has_unfinished_requests():
        for i in [i for i in pending if arrivals[i] <= step]:
            engine.add_request(str(i), pending.pop(i), params)
        for i, when in abort_at.items():
            if when == step and str(i) in engine.requests:
                done[str(i)] = engine.abort_request(str(i))
        for output in engine.step():
            done[output.request_id] = output
        step += 1
    return done


@pytest.mark.parametrize("method", METHODS)
def test_prefix_hits_preemption_and_chunked_prefill_in_the_same_batch(method, spec_config, make_llm, random_prompts):
    """Requests sharing a prefix arrive while others decode; prompts come in 16-token chunks and
    the cache is small enough that decodes preempt each other."""
    shared = random_prompts(1, 24, 24, seed=11)[0]
    prompts = [shared + p for p in _repetitive_prompts(random_prompts, 8, seed=12)]
    params = SamplingParams(**GREEDY, max_tokens=40)
    arrivals = {i: 3 * i for i in range(len(prompts))}
    engine_kwargs = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory=56 * BLOCK_BYTES)
    reference = _run_staggered(make_llm(**engine_kwargs), prompts, params, arrivals)
    llm = make_llm(**engine_kwargs, speculative_config=spec_config(method))
    outputs = _run_staggered(llm, prompts, params, arrivals)
    assert {k: v.outputs[0].token_ids for k, v in outputs.items()} == {
        k: v.outputs[0].token_ids for k, v in reference.items()}
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and _accepted(llm.engine) > 0
    _no_leaks(llm.engine)


@pytest.mark.parametrize("method", METHODS)
def test_many_aborted_speculative_streams_leave_no_block_behind(method, spec_config, make_llm, random_prompts):
    prompts = _repetitive_prompts(random_prompts, 24, seed=21)
    rng = random.Random(0)
    arrivals = {i: rng.randrange(0, 20) for i in range(len(prompts))}
    aborts = {i: arrivals[i] + rng.randrange(1, 12) for i in range(len(prompts)) if i % 4 != 3}
    llm = make_llm(block_size=4, max_num_seqs=8, speculative_config=spec_config(method))
    done = _run_staggered(llm, prompts, SamplingParams(**GREEDY, max_tokens=48), arrivals, aborts)
    reasons = [done[str(i)].outputs[0].finish_reason for i in range(len(prompts))]
    assert reasons.count("abort") >= 12 and reasons.count("length") >= 6
    assert _accepted(llm.engine) > 0
    _no_leaks(llm.engine)


@pytest.mark.parametrize("method", METHODS)
def test_n_greater_than_one_and_seeded_sampled_requests_replay(method, spec_config, make_llm, random_prompts):
    """Sampled rows keep a deterministic draft where the sample equals it, a draft model's by
    rejection sampling (its distribution: test_spec_rejection_sampling.py); a seeded request
    gives the same output twice, and with deterministic drafts the output it has without any
    (its i-th token always uses its generator's i-th draw)."""
    prompts = _repetitive_prompts(random_prompts, 3, seed=8)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, n=2, seed=7, ignore_eos=True)
    llm = make_llm(block_size=4, speculative_config=spec_config(method))
    outputs = llm.generate(prompts, params)
    assert all(len(c.token_ids) == 30 for o in outputs for c in o.outputs)
    again = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outputs]
    if method != "draft_model":
        plain = make_llm(block_size=4).generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in plain] == [[c.token_ids for c in o.outputs] for o in outputs]
    assert _accepted(llm.engine) > 0
    _no_leaks(llm.engine)


def test_spec_decode_counters_add_up(make_llm, random_prompts):
    llm = make_llm(speculative_config=NGRAM)
    llm.generate(_repetitive_prompts(random_prompts, 4, seed=2), SamplingParams(**GREEDY, max_tokens=32))
    spec = llm.engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens <= 4 * spec.num_drafts
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens and len(spec.accepted_per_pos) == 4
    assert spec.accepted_per_pos == sorted(spec.accepted_per_pos, reverse=True)
    assert make_llm().engine.stats().spec_decode is None   # off: no counters (vLLM shows none either)


class Recording:
    """Proposes `wrong` tokens (never accepted) or nothing; records each call's step and batch
    size (of `engine`, set once the engine it drafts for is built)."""

    def __init__(self, wrong: bool = True) -> None:
        self.engine, self.wrong, self.calls = None, wrong, []

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        self.calls.append((self.engine.counters.num_steps, len(self.engine.scheduler.running)))
        return [(seq.token_ids[-1] + 1 + i) % 384 for i in range(min(2, max_tokens))] if self.wrong else []


def test_no_drafts_in_a_step_with_more_running_sequences_than_disable_by_batch_size(make_llm, random_prompts):
    from kubeinfer.server.engine.spec_decode.speculator import Speculator

    prompts = random_prompts(6, 4, 12, seed=4)
    params = [SamplingParams(**GREEDY, max_tokens=4 + 6 * i) for i in range(6)]   # the batch shrinks
    proposer = Recording()
    llm = make_llm(speculator=Speculator(proposer, 2, disable_by_batch_size=3))
    proposer.engine = llm.engine
    outputs = llm.generate(prompts, params)
    assert _token_ids(outputs) == _token_ids(make_llm().generate(prompts, params))
    assert proposer.calls and all(running <= 3 for _, running in proposer.calls)
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0


def test_a_sequence_whose_drafts_are_rejected_pauses_drafting_and_retries(make_llm, random_prompts):
    from kubeinfer.server.engine.spec_decode.speculator import Speculator

    prompt = random_prompts(1, 6, 6, seed=4)[0]
    params = SamplingParams(**GREEDY, max_tokens=200)
    proposer = Recording()
    llm = make_llm(speculator=Speculator(proposer, 2, min_acceptance_rate=0.3, acceptance_retry_steps=4))
    proposer.engine = llm.engine
    [output] = llm.generate([prompt], params)
    assert output.outputs[0].token_ids == make_llm().generate([prompt], params)[0].outputs[0].token_ids
    steps = [step for step, _ in proposer.calls]
    # always rejected: the average falls below 0.3 within 4 drafted steps, then the pauses
    # double (4, 8, 16, 32 steps...), so over ~200 steps only a handful of steps draft
    assert 6 <= len(steps) <= 30 and llm.engine.counters.num_steps >= 190
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert max(gaps) >= 32


def test_the_speculative_config_takes_vllm_shapes():
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 4, 4)
    legacy = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (legacy.method, legacy.model, legacy.prompt_lookup_min) == ("ngram", None, 5)
    draft = parse_speculative_config({"model": "/models/small", "num_speculative_tokens": 4})
    assert draft.method == "draft_model" and draft.model == "/models/small"
    assert parse_speculative_config("") is None and parse_speculative_config(None) is None
    assert parse_speculative_config(ngram.to_json()) == ngram
    for bad, message in (({"method": "eagle", "num_speculative_tokens": 2}, "must be one of ngram, suffix"),
                         ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, "in [1, 64]"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                           "prompt_lookup_max": 2}, "1 <= min <= max"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key(s) lookahead"),
                         ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
                         ("{not json", "not JSON")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            parse_speculative_config(bad)
    assert isinstance(ngram, SpeculativeConfig)
    from kubeinfer.server.engine.config import EngineConfig

    with pytest.raises(ValueError, match="draft model with tensor_parallel_size > 1 is not supported"):
        EngineConfig(tensor_parallel_size=2, speculative_config=draft)
    assert EngineConfig(tensor_parallel_size=2, speculative_config=ngram).speculative_config == ngram


def test_a_draft_model_with_another_tokenizer_is_refused(make_llm, draft_model_path, tmp_path):
    import json
    import shutil

    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_model_path, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]   # two ids swapped: other text
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target .* tokenizer .* 2 of them with another id"):
        make_llm(speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_embedded_model_fp32_greedy_output_is_unchanged_by_ngram_and_suffix_drafts():
    """SmolLM2-135M-Instruct in float32, chat prompts that ask to repeat and rewrite a passage of
    the benchmark corpus (answers copy from the prompt, so drafts are kept often)."""
    from pathlib import Path

    from kubeinfer.server.model.loader import load_model

    loaded = load_model("embedded", dtype="float32", device="cpu")
    passage = (Path(__file__).resolve().parents[2] / "benchmarks" / "corpus" / "gettysburg.txt").read_text()
    passage = passage.split("\n\n")[1]
    tasks = ("Repeat the text above word for word.", "Rewrite the text above, replacing 'nation' with 'country'.")
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": f"{passage}\n\n{task}"}])
               for task in tasks]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = LLM(loaded_model=loaded, kv_cache_memory=64 << 20).generate(prompts, params)
    for config in (NGRAM, {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0}):
        llm = LLM(loaded_model=loaded, kv_cache_memory=64 << 20, speculative_config=config)
        got = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 10


_GRAMMARS = (
    {"json": {"type": "object", "additionalProperties": False, "required": ["role", "notes"],
              "properties": {"role": {"enum": ["admin", "user"]}, "notes": {"type": "string", "maxLength": 12}}}},
    {"regex": "(the |a |cat |sat |on |mat ){4,40}done"},
    {"grammar": 'root ::= item (", " item)* "."\nitem ::= "alpha" | "beta" | "gamma" | [a-z]+'},
)


def _constrained_params(max_tokens: int = 48) -> list[SamplingParams]:
    from kubeinfer.server.engine.sampling_params import StructuredOutputsParams

    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**g))
            for g in _GRAMMARS]


@pytest.mark.parametrize("method", METHODS)
def test_grammar_constrained_requests_are_drafted_and_greedy_output_is_unchanged(
        method, spec_config, make_llm, random_prompts):
    """Structured outputs (JSON schema, regex, EBNF) are drafted: each draft is checked through
    the request's grammar, every draft position is masked as the grammar stands after the
    drafts before it, and the matcher rolls back what was not kept. Greedy output equals the
    non-speculative engine's token for token, unconstrained neighbours too, and drafts of
    constrained requests are kept."""
    prompts = _repetitive_prompts(random_prompts, 5, seed=31)
    params = _constrained_params() + [SamplingParams(**GREEDY, max_tokens=30)] * 2
    want = make_llm().generate(prompts, params)
    llm = make_llm(speculative_config=spec_config(method))
    kept: dict[str, int] = {}
    original = llm.engine.speculator.verified

    def verified(seq, num_drafts, num_accepted):
        if seq.logits_processors:
            kept[seq.request.request_id] = kept.get(seq.request.request_id, 0) + num_accepted
        original(seq, num_drafts, num_accepted)
    llm.engine.speculator.verified = verified
    got = llm.generate(prompts, params)
    assert _token_ids(got) == _token_ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert got[0].outputs[0].text.startswith(('{"role": "admin", "notes": "', '{"role": "user", "notes": "'))
    assert sum(kept.values()) > 0, kept
    _no_leaks(llm.engine)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampled_constrained_requests_replay_and_stay_in_their_grammar(method, spec_config, make_llm,
                                                                             random_prompts):
    """Sampled (n=2, seeded) requests under a grammar: with deterministic drafts the output is
    the one without speculation, with a draft model's (rejection sampling against the masked
    distribution) it replays exactly; every finished output matches its grammar."""
    import json
    import re

    from kubeinfer.server.engine.sampling_params import StructuredOutputsParams

    prompts = _repetitive_prompts(random_prompts, 2, seed=41)
    sampled = dict(temperature=0.8, top_k=20, max_tokens=48, n=2, seed=11)
    params = [SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(**_GRAMMARS[1])),
              SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(**_GRAMMARS[0]))]
    llm = make_llm(speculative_config=spec_config(method))
    outputs = llm.generate(prompts, params)
    tokens = [[c.token_ids for c in o.outputs] for o in outputs]
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == tokens
    if method != "draft_model":
        assert [[c.token_ids for c in o.outputs] for o in make_llm().generate(prompts, params)] == tokens
    for completion in outputs[0].outputs:
        if completion.finish_reason == "stop":
            assert re.fullmatch(_GRAMMARS[1]["regex"], completion.text)
    for completion in outputs[1].outputs:
        if completion.finish_reason == "stop":
            assert json.loads(completion.text)["role"] in ("admin", "user")
    if method != "draft_model":   # the draft model samples without the grammar: few of its drafts fit it
        assert _accepted(llm.engine) > 0
    _no_leaks(llm.engine)


class _FailsMidVerify:
    """A grammar matcher that raises once it has taken a draft: while a draft position's mask
    is filled ("fill"), or while it takes a second draft ("accept": checking or positioning)."""

    def __init__(self, processor, where: str) -> None:
        self.processor, self.matcher, self.where = processor, processor.matcher, where
        self.raised = 0

    def fill_next_token_bitmask(self, bitmask, row):
        if self.where == "fill" and self.processor._ahead:
            self.raised += 1
            raise RuntimeError("grammar fault mid-verify")
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token):
        if self.where == "accept" and self.processor._ahead:
            self.raised += 1
            raise RuntimeError("grammar fault mid-verify")
        return self.matcher.accept_token(token)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


@pytest.mark.parametrize("where", ["fill", "accept"])
def test_a_grammar_that_raises_mid_verify_fails_only_its_own_request(where, make_llm, random_prompts):
    """One constrained request's matcher raises while its drafts are checked or its draft
    positions masked: that request alone fails (an error output), every block comes back, and
    the other constrained and unconstrained requests of the same steps are token-identical to
    the engine without speculation; the engine serves the next request as before."""
    prompts = _repetitive_prompts(random_prompts, 4, seed=31)
    constrained = _constrained_params()
    params = [constrained[1], constrained[1], constrained[0], SamplingParams(**GREEDY, max_tokens=30)]
    want = make_llm().generate(prompts, params)
    llm = make_llm(speculative_config=NGRAM)
    engine = llm.engine
    requests = [engine.make_request(str(i), prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
    processor = requests[0].seqs[0].logits_processors[0]
    faulty = processor.matcher = _FailsMidVerify(processor, where)
    done = run_requests(engine, requests)
    assert faulty.raised > 0
    assert done["0"].error is not None and done["0"].outputs[0].finish_reason == "error"
    for i in (1, 2, 3):
        assert done[str(i)].error is None
        assert done[str(i)].outputs[0].token_ids == want[i].outputs[0].token_ids
    assert _accepted(engine) > 0
    _no_leaks(engine)
    again = llm.generate([prompts[0]], [params[0]])
    assert again[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    _no_leaks(engine)
