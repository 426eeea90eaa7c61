"""Structured outputs in the engine (tiny random Qwen2, a real byte-level BPE vocabulary):
grammars hold at any temperature, leave unconstrained neighbours token-identical, survive
preemption and abort, and bad specs are refused with a message that names the problem.

NOTE: string schemas here carry an ASCII `pattern`. A random model writes arbitrary bytes, and
xgrammar accepts the UTF-8 encoding of a surrogate (ED A0-BF xx), which Python decodes as three
U+FFFD, so a `maxLength` would be exceeded after decoding; real models do not write these.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers.engine_runs import run_requests

from kubeinfer.server.engine.logits_processor import LogitsProcessor
from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams
from kubeinfer.server.engine.sampling_params import StructuredOutputsParams as Structured

pytestmark = pytest.mark.integration

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{0,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


def _texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_json_schema_holds_at_temperature_one(make_llm, random_prompts):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, n=8, max_tokens=80, seed=1, structured_outputs=Structured(json=PERSON))
    outputs = llm.generate(random_prompts(2, 4, 12), params)
    for choice in (c for o in outputs for c in o.outputs):
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)
    assert llm.engine.stats().kv_cache_usage == 0.0  # no block held past its request


def test_regex_choice_and_grammar_hold(make_llm, random_prompts):
    llm = make_llm()
    prompts = random_prompts(3, 4, 12, seed=2)
    specs = [Structured(regex=r"(red|blue)-[0-9]{2,3}"), Structured(choice=["yes", "no", 'say "hi"']),
             Structured(grammar='root ::= "(" [a-c]+ ")"')]
    outputs = llm.generate(prompts, [SamplingParams(temperature=1.0, n=6, max_tokens=24, structured_outputs=s)
                                     for s in specs])
    regex, choice, grammar = ([c.text for c in o.outputs] for o in outputs)
    assert all(re.fullmatch(r"(red|blue)-[0-9]{2,3}", text) for text in regex), regex
    assert all(text in ("yes", "no", 'say "hi"') for text in choice), choice
    assert all(re.fullmatch(r"\([a-c]+\)", text) for o in outputs[2:] for text in grammar
               if o.outputs[0].finish_reason == "stop"), grammar


def test_json_object_is_an_object(make_llm, random_prompts):
    llm = make_llm()
    outputs = llm.generate(random_prompts(4, 4, 12, seed=5), SamplingParams(
        temperature=0.8, max_tokens=120, seed=3, structured_outputs=Structured(json_object=True)))
    for choice in (c for o in outputs for c in o.outputs):
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.finish_reason == "length" and choice.text.startswith("{")


def test_free_rows_are_token_identical_next_to_constrained_ones(make_llm, random_prompts):
    free = random_prompts(6, 6, 20, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = make_llm().generate(free, greedy)
    llm = make_llm()
    schemas = [PERSON, {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
               {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]
    constrained = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=Structured(json=s))
                   for s in schemas * 2]
    mixed = llm.generate(free + random_prompts(6, 6, 20, seed=12), [greedy] * 6 + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:6]] == [o.outputs[0].token_ids for o in alone]
    for output, params in zip(mixed[6:], constrained):
        choice = output.outputs[0]
        if choice.finish_reason == "stop":
            schema = params.structured_outputs.json
            jsonschema.validate(json.loads(choice.text), schema)


def test_preemption_by_recompute_keeps_the_grammar_consistent(make_llm, random_prompts):
    llm = make_llm(kv_cache_memory=96 * 1024, max_num_seqs=16)  # too small for all: preempts
    params = SamplingParams(temperature=1.0, max_tokens=60, seed=4, structured_outputs=Structured(json=PERSON))
    outputs = llm.generate(random_prompts(12, 20, 40, seed=6), params)
    assert llm.engine.scheduler.num_preemptions > 0
    for choice in (c for o in outputs for c in o.outputs):
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_abort_releases_matchers_and_blocks(make_llm, random_prompts):
    llm = make_llm()
    engine = llm.engine
    request = engine.add_request("a", random_prompts(1, 8, 8)[0], SamplingParams(
        n=3, max_tokens=50, structured_outputs=Structured(json=PERSON)))
    engine.step()
    engine.step()
    assert all(seq.logits_processors for seq in request.seqs)
    final = engine.abort_request("a")
    assert final is not None and final.finished
    assert all(not seq.logits_processors for seq in request.seqs)
    assert engine.stats().kv_cache_usage == 0.0


def test_grammar_unfinished_at_max_tokens_ends_with_length(make_llm, random_prompts):
    schema = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{40,}$"}, "minItems": 2}
    [output] = make_llm().generate(random_prompts(1, 8, 8), SamplingParams(
        temperature=0.0, max_tokens=10, structured_outputs=Structured(json=schema)))
    choice = output.outputs[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 10
    assert choice.text.startswith('["')


def test_min_tokens_cannot_trap_a_finished_grammar(make_llm, random_prompts):
    [output] = make_llm().generate(random_prompts(1, 8, 8), SamplingParams(
        temperature=1.0, max_tokens=20, min_tokens=15, structured_outputs=Structured(choice=["ok"])))
    assert output.outputs[0].text == "ok" and output.outputs[0].finish_reason == "stop"


def test_a_constraint_stuck_midway_fails_alone_as_the_clients_error(make_llm, random_prompts):
    """A JSON string whose pattern needs a raw control character: `"a` is written, then no token
    may follow (JSON rows never write one raw). That request alone fails, as its own error (a
    400 at the API), with nothing left behind; its free neighbour is token-identical to a run alone."""
    llm = make_llm()
    stuck = SamplingParams(temperature=0.0, max_tokens=10,
                           structured_outputs=Structured(json={"type": "string", "pattern": "^a\u0016$"}))
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(2, 8, 8, seed=3)
    failed, neighbour = llm.generate(prompts, [stuck, free])
    assert failed.finished and failed.client_error
    assert "cannot be completed" in failed.error and failed.outputs[0].finish_reason == "error"
    assert _texts([neighbour]) == _texts(llm.generate(prompts[1:], free)) and len(neighbour.outputs[0].token_ids) == 6
    assert not llm.engine.requests and llm.engine.stats().kv_cache_usage == 0.0


def test_a_seeded_constrained_request_replays(make_llm, random_prompts):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, max_tokens=60, seed=9, structured_outputs=Structured(json=PERSON))
    prompt = random_prompts(1, 8, 8)
    assert _texts(llm.generate(prompt, params)) == _texts(llm.generate(prompt, params))


@pytest.mark.parametrize("spec, message", [
    (Structured(regex="[a-"), "invalid regex"),
    (Structured(json={"type": "frobnicate"}), "invalid JSON schema"),
    (Structured(json="{not json"), "invalid JSON schema"),
    (Structured(grammar="root ::= undefined_rule"), "invalid grammar"),
    (Structured(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "'not' at /properties/a"),
    (Structured(json={"type": "string", "pattern": "^a+$", "maxLength": 3}), "'pattern' together with"),
    (Structured(regex="a", choice=["b"]), "exactly one"),
    (Structured(choice=[]), "non-empty list"),
])
def test_bad_specs_are_refused_with_a_reason(make_llm, spec, message):
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.make_request("bad", [5, 6, 7], SamplingParams(structured_outputs=spec))
    assert not llm.engine.requests


def test_properties_named_like_keywords_are_names():
    """A property called "if" or "not" is data, not the keyword (hypothesis found "if" refused);
    the keyword inside such a property is still found."""
    from kubeinfer.server.engine.structured_output import unsupported_feature
    named = {"type": "object", "properties": {"if": {"type": "string"}, "not": {"type": "integer"}},
             "$defs": {"contains": {"type": "boolean"}}}
    assert unsupported_feature(named) is None
    assert unsupported_feature({"type": "object", "properties": {"if": {"not": {"type": "string"}}}}) \
        == "'not' at /properties/if"


def test_ignore_eos_is_refused_with_a_grammar(make_llm):
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        make_llm().engine.make_request("x", [5, 6], SamplingParams(
            ignore_eos=True, structured_outputs=Structured(choice=["a"])))


class _Ban(LogitsProcessor):
    def __init__(self, token: int) -> None:
        self.token = token
        self.seen: list[int] = []

    def apply(self, row: torch.Tensor) -> None:
        row[self.token] = float("-inf")

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)


def test_a_logits_processor_touches_only_its_rows(make_llm, random_prompts):
    """The seam itself: a "ban the greedy token" processor on one request changes that
    request's tokens only, sees exactly the tokens it got, and the neighbour is unchanged."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(2, 8, 16, seed=21)
    free = make_llm().generate(prompts, greedy)
    banned = free[0].outputs[0].token_ids[0]
    llm = make_llm()
    requests = [llm.engine.make_request(str(i), prompt, greedy) for i, prompt in enumerate(prompts)]
    ban = _Ban(banned)
    requests[0].seqs[0].logits_processors.append(ban)
    done = run_requests(llm.engine, requests)
    assert banned not in done["0"].outputs[0].token_ids
    assert ban.seen == done["0"].outputs[0].token_ids
    assert done["1"].outputs[0].token_ids == free[1].outputs[0].token_ids


# -- property: any schema in the supported subset, every finished output validates ---------------

_LEAVES = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z0-9 ]{{0,{n}}}$"}, st.integers(0, 6)),
    st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["a", "b", "c", 1, 2, True, None]),
                                                        min_size=1, max_size=4, unique=True)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
)


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, required_mask: list[bool]) -> dict:
        names = sorted(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [name for name, keep in zip(names, required_mask) if keep]}
    return st.builds(build, st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), children,
                                            min_size=1, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3))


_SCHEMAS = st.recursive(_LEAVES, lambda children: st.one_of(
    _objects(children),
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
), max_leaves=6)


@pytest.fixture(scope="module")
def property_llm(tiny_qwen2):
    from kubeinfer.server.engine.llm import LLM

    return LLM(loaded_model=tiny_qwen2[0], kv_cache_memory=4 << 20)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS, seed=st.integers(0, 1000))
def test_every_finished_output_validates_against_its_schema(property_llm, schema, seed):
    params = SamplingParams(temperature=1.0, n=2, max_tokens=48, seed=seed, structured_outputs=Structured(json=schema))
    [output] = property_llm.generate([[5, 17, 42, 9]], params)
    for choice in output.outputs:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), schema)
        else:
            assert choice.finish_reason == "length" and len(choice.token_ids) == 48


def test_bounded_strings_compile_to_a_pattern_with_the_same_strings(make_llm):
    """maxLength strings become an equivalent pattern (xgrammar fills masks inside a small
    maxLength repetition 5-12 ms a row; the pattern's automaton in microseconds)."""
    import xgrammar as xgr

    from kubeinfer.server.engine.structured_output import bounded_strings_as_patterns

    backend = make_llm().engine.grammars
    for schema in ({"type": "string", "maxLength": 5}, {"type": "string", "minLength": 2, "maxLength": 4},
                   {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"],
                    "additionalProperties": False}):
        rewritten = bounded_strings_as_patterns(schema)
        assert "maxLength" not in json.dumps(rewritten) and "pattern" in json.dumps(rewritten)
        as_pattern = backend.compile(Structured(json=schema))
        as_written = backend.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        words = ["", "a", "ab", "abc", "abcd", "abcde", "abcdef", "Zoë", "東京駅です", "a b", "a\\\"b", "a\\u0041"]
        for word in words:
            text = json.dumps({"a": word}, ensure_ascii=False) if schema["type"] == "object" else f'"{word}"'
            verdicts = []
            for compiled in (as_pattern, as_written):
                matcher = xgr.GrammarMatcher(compiled)
                verdicts.append(matcher.accept_string(text) and matcher.accept_token(backend.stop_token_ids[0]))
            assert verdicts[0] == verdicts[1], (schema, text, verdicts)
            if "\\" not in word:   # xgrammar's maxLength takes no escapes; the others follow the schema
                value = json.loads(text)
                assert verdicts[0] == jsonschema.Draft202012Validator(schema).is_valid(value), (schema, text)
    large = {"type": "string", "maxLength": 500}   # fast in xgrammar already; the pattern would compile slowly
    assert bounded_strings_as_patterns(large) == large
