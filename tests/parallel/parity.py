"""Greedy outputs of a tensor-parallel engine against the TP=1 engine on the same weights.

Same near-tie rule as tests/engine's transformers parity: where a sequence first diverges, both
chosen tokens must be in each other's top-2 and their logit gap under `tie_gap`; up to there the
chosen tokens' logprobs agree within `logprob`. TP sums partial products in another order, so
bit-exact logits are not expected.
"""

from __future__ import annotations

from kubeinfer.server.engine.outputs import RequestOutput


def assert_greedy_parity(ours: list[RequestOutput], reference: list[RequestOutput], tie_gap: float,
                         logprob: float) -> None:
    diverged = 0
    for mine_out, ref_out in zip(ours, reference, strict=True):
        mine_seq, ref_seq = mine_out.outputs[0], ref_out.outputs[0]
        for step, (mine, theirs) in enumerate(zip(mine_seq.token_ids, ref_seq.token_ids)):
            ref_top, our_top = ref_seq.logprobs[step], mine_seq.logprobs[step]
            if mine != theirs:
                assert mine in ref_top and theirs in our_top, (
                    f"prompt {mine_out.request_id} step {step}: TP chose {mine}, TP=1 {theirs}, not each other's top-2")
                gap = ref_top[theirs].logprob - ref_top[mine].logprob
                assert gap < tie_gap, f"prompt {mine_out.request_id} step {step}: gap {gap:.5f} is not a near-tie"
                diverged += 1
                break
            assert abs(our_top[mine].logprob - ref_top[mine].logprob) < logprob, (
                f"prompt {mine_out.request_id} step {step}: logprob {our_top[mine].logprob} vs "
                f"{ref_top[mine].logprob}")
        else:
            assert mine_seq.token_ids == ref_seq.token_ids, f"prompt {mine_out.request_id}: lengths differ"
    assert diverged <= len(ours) // 4, f"{diverged} of {len(ours)} prompts diverged"
