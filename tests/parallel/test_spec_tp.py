"""Speculative decoding under tensor parallelism: the drafts' extra query positions and the
several logits rows per sequence travel in the TP step like any other; greedy output with n-gram
drafts at TP=2 equals TP=1 without drafts."""

from __future__ import annotations

import pytest

from helpers.tiny_models import make_tiny_llama
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_ngram_drafts_at_tp2_give_tp1_greedy_output(tmp_path, make_tp_llm):
    path = str(make_tiny_llama(tmp_path))
    prompts = [[11, 12, 13, 14, 15] * 3 + [16], [40, 41, 42, 43] * 4, [90, 91, 92, 93, 94, 95, 96]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = LLM(path, **ENGINE).generate(prompts, params)
    llm = make_tp_llm(path, tensor_parallel_size=2, speculative_config=NGRAM, **ENGINE)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
