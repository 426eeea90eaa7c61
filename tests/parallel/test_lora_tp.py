"""LoRA under tensor parallelism (gloo on the CPU): adapters sharded like the layers they patch
(column layers' B by rows, row layers' A by columns, the delta summed by the all-reduce) give
the TP=1 tokens, for a batch mixing adapters and the base, with slots refilled on every rank."""

from __future__ import annotations

import pytest

from helpers.lora_adapters import make_peft_adapter
from helpers.tiny_models import build_tiny_llama
from parity import assert_greedy_parity

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.flags import LoRAModuleSpec

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              enable_lora=True, max_loras=2)
PROMPTS = [[5, 17, 250, 33, 90, 91, 92, 7, 300, 12], [100, 101, 102, 103, 104, 105], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


def test_tp2_with_adapters_matches_tp1(tmp_path, make_tp_llm):
    base, _ = build_tiny_llama(tmp_path / "base", num_kv_heads=2)
    all_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    modules = [LoRAModuleSpec(name, str(make_peft_adapter(base, tmp_path / name, rank=rank, targets=targets,
                                                          seed=seed)[0]))
               for seed, (name, rank, targets) in enumerate([("a", 8, all_targets), ("b", 16, ["o_proj", "down_proj"]),
                                                             ("c", 8, ["k_proj", "v_proj", "up_proj"])])]
    prompts = PROMPTS * 2
    adapters = ["a", "b", None, "c", "a", "b"]   # three adapters in two slots: refilled as they take turns
    reference = LLM(str(base), lora_modules=modules, **ENGINE).generate(prompts, GREEDY, adapter=adapters)
    outputs = make_tp_llm(str(base), tensor_parallel_size=2, lora_modules=modules, **ENGINE).generate(
        prompts, GREEDY, adapter=adapters)
    assert_greedy_parity(outputs, reference, tie_gap=1e-3, logprob=1e-4)
    assert len({tuple(o.outputs[0].token_ids) for o in reference}) == len(prompts)
