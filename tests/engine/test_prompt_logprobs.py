"""Prompt logprobs (vLLM's `prompt_logprobs`) equal transformers' log-softmax of the same model's
logits at every prompt position: float32, within 1e-4 nats (measured ~2e-6 on the tiny models:
only op order differs). Across prefill chunks, with the prefix cache cold and warm (a request
that asks is recomputed, never served from cached blocks), in a batch of 8 mixed requests, with
a LoRA adapter (against PEFT) and a compressed-tensors checkpoint (against its dequantized model).
"""

from __future__ import annotations

import pytest
import torch
from helpers.lora_adapters import make_peft_adapter
from helpers.quantized_models import quantize_compressed_tensors
from helpers.tiny_models import build_tiny_llama

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.flags import LoRAModuleSpec
from kubeinfer.server.model.loader import load_model

ATOL = 1e-4
GREEDY = dict(temperature=0.0, ignore_eos=True)


def reference_logprobs(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is the log-softmax of the logits after ids[:p + 1]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def assert_prompt_logprobs(output, reference: torch.Tensor, prompt: list[int], k: int) -> None:
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        row, token, entry = reference[position - 1], prompt[position], entries[position]
        assert abs(entry[token].logprob - float(row[token])) < ATOL, f"position {position}"
        assert entry[token].rank == int((row > row[token]).sum()) + 1, f"position {position}: rank"
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert len(top) == k
        expected = row.topk(k).values.tolist()
        assert all(abs(mine.logprob - theirs) < ATOL for mine, theirs in zip(top, expected)), f"position {position}: top-{k}"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("llama"))


def _prompts(count: int, low: int, high: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [(prefix or []) + torch.randint(3, 384, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.unit
def test_chunked_prefill_with_the_prefix_cache_cold_and_warm(tiny_llama):
    path, hf_model = tiny_llama
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              enable_prefix_caching=True)
    shared = _prompts(1, 40, 40, seed=1)[0]
    cold, warm = _prompts(2, 5, 30, seed=2, prefix=shared)
    first = llm.generate([cold], SamplingParams(max_tokens=3, prompt_logprobs=4, **GREEDY))[0]
    assert first.num_cached_tokens == 0
    assert_prompt_logprobs(first, reference_logprobs(hf_model, cold), cold, 4)
    # the shared prefix is cached now: a request without prompt logprobs is served from it ...
    hit = llm.generate([warm], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert hit.num_cached_tokens >= 36 and hit.prompt_logprobs is None
    # ... one that asks recomputes it, and gets the same tokens
    scored = llm.generate([warm], SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY))[0]
    assert scored.num_cached_tokens == 0
    assert_prompt_logprobs(scored, reference_logprobs(hf_model, warm), warm, 2)
    assert scored.outputs[0].token_ids == hit.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total   # nothing leaked


@pytest.mark.unit
def test_a_batch_of_8_mixed_requests(tiny_llama):
    path, hf_model = tiny_llama
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=96, kv_cache_memory=4 << 20,
              enable_prefix_caching=True)
    prompts = _prompts(8, 2, 45, seed=3)
    asks = [3, None, 0, 5, None, 1, 20, None]   # prompt_logprobs per request
    alone = [llm.generate([p], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids for p in prompts]
    params = [SamplingParams(max_tokens=4, prompt_logprobs=k, logprobs=2 if i % 3 == 0 else None,
                             n=2 if i == 5 else 1, **GREEDY) for i, k in enumerate(asks)]
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), engine.make_request(str(i), prompt, p))
    done, together = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        together = max(together, len({seq.request.request_id for seq in engine.scheduler.running}))
    assert together == 8   # prefill chunks and decodes of all of them in the same steps
    for i, (prompt, k) in enumerate(zip(prompts, asks)):
        output = done[str(i)]
        assert [c.token_ids for c in output.outputs] == [alone[i]] * len(output.outputs)
        if k is None:
            assert output.prompt_logprobs is None
        else:
            assert_prompt_logprobs(output, reference_logprobs(hf_model, prompt), prompt, k)


@pytest.mark.unit
def test_with_a_lora_adapter_against_peft(tmp_path):
    from peft import PeftModel

    base, _ = build_tiny_llama(tmp_path / "base")
    adapter, _ = make_peft_adapter(base, tmp_path / "a", rank=8, targets=["q_proj", "v_proj", "down_proj"], seed=3)
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           str(adapter)).eval()
    llm = LLM(str(base), dtype="float32", kv_cache_memory=4 << 20, enable_lora=True, max_num_batched_tokens=16,
              lora_modules=[LoRAModuleSpec("a", str(adapter))])
    prompt = _prompts(1, 37, 37, seed=4)[0]
    output = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY), adapter="a")[0]
    reference = reference_logprobs(peft_model, prompt)
    with peft_model.disable_adapter():   # the adapter moves them: a base-model answer would fail
        assert (reference - reference_logprobs(peft_model, prompt)).abs().max() > 100 * ATOL
    assert_prompt_logprobs(output, reference, prompt, 3)


@pytest.mark.unit
def test_with_a_compressed_tensors_checkpoint(tmp_path):
    path, hf_model = build_tiny_llama(tmp_path / "base")
    scheme = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}
    quantized, reference_model = quantize_compressed_tensors(path, hf_model, scheme, tmp_path / "w4a16")
    llm = LLM(loaded_model=load_model(str(quantized), dtype="float32", device="cpu"), kv_cache_memory=4 << 20,
              max_num_batched_tokens=16)
    prompt = _prompts(1, 30, 30, seed=5)[0]
    output = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY))[0]
    reference = reference_logprobs(reference_model, prompt)
    assert (reference - reference_logprobs(hf_model, prompt)).abs().max() > 100 * ATOL   # quantization shows
    assert_prompt_logprobs(output, reference, prompt, 2)


@pytest.mark.integration
def test_embedded_smollm2_cold_and_warm(smollm2_reference):
    loaded = load_model("embedded", dtype="float32", device="cpu")
    tokenizer = loaded.tokenizer
    system = tokenizer.encode("<|im_start|>system\nYou are a careful assistant who answers briefly.<|im_end|>\n",
                              add_special_tokens=False)
    prompts = [system + tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n", add_special_tokens=False)
               for q in ("What is the capital of France?", "Name three primary colours, please.")]
    llm = LLM(loaded_model=loaded, max_num_batched_tokens=24, kv_cache_memory=16 << 20, enable_prefix_caching=True)
    cold = llm.generate([prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))[0]
    plain = llm.generate([prompts[1]], SamplingParams(max_tokens=1, **GREEDY))[0]
    warm = llm.generate([prompts[1]], SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))[0]
    assert plain.num_cached_tokens >= 16 and warm.num_cached_tokens == 0   # cached, and recomputed
    for output, prompt in ((cold, prompts[0]), (warm, prompts[1])):
        assert_prompt_logprobs(output, reference_logprobs(smollm2_reference, prompt), prompt, 2)


@pytest.mark.unit
@pytest.mark.parametrize("n", [1, 3])
def test_a_scoring_fault_fails_its_request_alone(tiny_llama, monkeypatch, n):
    """Scoring a prompt raises mid-step: that request ends with an error (its n sequences retired
    and their blocks freed before the step's bookkeeping, which must skip them), a request in the
    same step completes, the engine takes the next request, and no block is leaked."""
    from kubeinfer.server.engine import prompt_logprobs as prompt_logprobs_module

    def broken(*args, **kwargs):
        raise RuntimeError("injected prompt-logprob fault")

    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20,
              enable_prefix_caching=True)
    monkeypatch.setattr(prompt_logprobs_module, "logprob_entries", broken)
    scored, plain = _prompts(2, 20, 30, seed=5)
    engine = llm.engine
    engine.add_request("scored", scored, SamplingParams(max_tokens=3, n=n, prompt_logprobs=0, **GREEDY))
    engine.add_request("plain", plain, SamplingParams(max_tokens=3, **GREEDY))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    assert final["scored"].error and "RuntimeError" in final["scored"].error
    assert final["plain"].error is None and len(final["plain"].outputs[0].token_ids) == 3
    after = llm.generate([plain], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert after.outputs[0].token_ids == final["plain"].outputs[0].token_ids
    stats = engine.stats()
    assert stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total   # nothing leaked
