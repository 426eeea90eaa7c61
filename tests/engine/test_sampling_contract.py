"""The sampling contract's two seams, end to end on the tiny Qwen2 engine.

Logits processors (the seam of `logits_processor.py`): a "ban token X" rule on one request next
to a drafted one. Speculative decoding: a test proposer feeds known tokens (the greedy continuation, some of them wrong); the engine scores several positions of a
sequence in one step, accepts 0..k drafts and the sampled token, and the output equals plain
greedy decoding token for token, in fewer steps, with every KV block given back.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine_runs import run_requests

from kubeinfer.server.engine.logits_processor import LogitsProcessor
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Sequence
from kubeinfer.server.engine.spec_decode.speculator import Speculator

pytestmark = pytest.mark.unit

GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


class BanToken(LogitsProcessor):
    """Sets one token's logit to -inf."""

    def __init__(self, token: int) -> None:
        self.token = token

    def apply(self, row: torch.Tensor) -> None:
        row[self.token] = float("-inf")


class KnownTokens:
    """Proposes the next tokens of a known continuation per request; every `wrong_every`-th
    proposal has its last token replaced, so the engine has to reject drafts too."""

    def __init__(self, continuations: dict[str, list[int]], wrong_every: int = 2) -> None:
        self.continuations, self.wrong_every, self.calls = continuations, wrong_every, 0

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        known = self.continuations[seq.request.request_id]
        drafts = known[seq.num_output_tokens:seq.num_output_tokens + min(max_tokens, 3)]
        self.calls += 1
        if drafts and self.calls % self.wrong_every == 0:
            drafts[-1] = (drafts[-1] + 1) % 384
        return drafts


def _no_leaks(llm) -> None:
    kv = llm.engine.kv
    cached = kv.cache.num_cached_blocks if kv.cache else 0
    assert kv.num_used_blocks == 0 and kv.pool.num_free == kv.pool.num_blocks - cached
    assert kv.pool.ref_counts.count(0) == kv.pool.num_free


def test_known_token_proposer_gives_greedy_output_in_fewer_steps(make_llm, random_prompts):
    prompts = random_prompts(4, 3, 40, seed=6)
    reference_llm = make_llm(block_size=4)
    reference = reference_llm.generate(prompts, SamplingParams(**GREEDY, logprobs=1))
    plain_steps = reference_llm.engine.counters.num_steps
    continuations = {str(i): o.outputs[0].token_ids for i, o in enumerate(reference)}
    proposer = KnownTokens(continuations)
    llm = make_llm(block_size=4, speculator=Speculator(proposer))
    outputs = llm.generate(prompts, SamplingParams(**GREEDY, logprobs=1))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    for ours, theirs in zip(outputs, reference):
        for mine, ref in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert mine.keys() == ref.keys()
            assert all(abs(mine[t].logprob - ref[t].logprob) < 1e-4 for t in mine)
    assert proposer.calls > 0 and llm.engine.counters.num_steps < plain_steps
    _no_leaks(llm)


def test_a_ban_token_processor_next_to_a_drafted_sequence(make_llm, random_prompts):
    """One batch, two requests: a "ban token X" processor on one (not drafted: processors follow
    accepted tokens only), known-token drafts for the other; both equal their references."""
    prompts = random_prompts(2, 8, 20, seed=9)
    greedy = SamplingParams(**GREEDY)
    plain = make_llm().generate(prompts, greedy)
    banned = plain[0].outputs[0].token_ids[0]

    def requests(llm):
        made = [llm.engine.make_request(str(i), prompt, greedy) for i, prompt in enumerate(prompts)]
        made[0].seqs[0].logits_processors.append(BanToken(banned))
        return made

    reference_llm = make_llm()
    reference = run_requests(reference_llm.engine, requests(reference_llm))
    proposer = KnownTokens({str(i): o.outputs[0].token_ids for i, o in enumerate(plain)})
    llm = make_llm(speculator=Speculator(proposer))
    done = run_requests(llm.engine, requests(llm))
    assert banned not in done["0"].outputs[0].token_ids
    assert done["0"].outputs[0].token_ids == reference["0"].outputs[0].token_ids
    assert done["1"].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert proposer.calls > 0
    _no_leaks(llm)


def test_a_stop_token_among_accepted_drafts_ends_the_sequence_there(make_llm, random_prompts):
    prompts = random_prompts(2, 8, 20, seed=10)
    plain = make_llm().generate(prompts, SamplingParams(**GREEDY))
    stop = plain[0].outputs[0].token_ids[6]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    reference = make_llm().generate(prompts, params)
    llm = make_llm(speculator=Speculator(KnownTokens({str(i): o.outputs[0].token_ids for i, o in enumerate(plain)},
                                                     wrong_every=5)))
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[0].outputs[0].token_ids[-1] == stop
    _no_leaks(llm)
