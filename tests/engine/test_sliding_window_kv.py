"""Sliding-window KV memory: on a model whose every layer attends to the last W positions
(Mistral, Phi-3), blocks that left the window go back to the pool while the sequence runs.

- the scheduler's random interleavings (test_scheduler's fake model, which checks every read
  slot holds the reader's own prefix) with a window: reads only inside the window, never a
  given-back block; no leak; prefix sharing, forks, preemption and truncation stay right;
- a 100-token greedy decode on tiny Mistral / Phi-3 (window 8, blocks of 4) holds at most
  W / block_size + 2 blocks per step, in a pool smaller than the sequence, and is transformers'
  greedy choice at every step: one transformers forward over prompt + output, each chosen
  token's logprob within 1e-4 and its argmax (or within 1e-3 of it: a near-tie);
- the prefix cache: what a sequence gave back is never served as a hit (it stops inserting
  once it gave a block back); later requests on the same prefix and past it equal transformers.
Gemma 2/3 interleave global layers, which read the whole context: nothing is given back there.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
import torch
from test_parity import GREEDY
from test_scheduler import BS, FakeModel, drive, operations

from helpers.tiny_models import build_tiny_gemma2, build_tiny_mistral, build_tiny_phi3
from kubeinfer.server.engine.kv_cache_manager import KVCacheManager
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.scheduler import Scheduler
from kubeinfer.server.engine.sequence import Sequence

pytestmark = pytest.mark.integration

WINDOW, BLOCK = 8, 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4   # K and V, 2 layers, 2 KV heads of 16, float32


class WindowedFakeModel(FakeModel):
    """A chunk reads only the keys its queries' windows cover (query p: keys > p - window)."""

    def __init__(self, kv: KVCacheManager, window: int) -> None:
        super().__init__(kv)
        self.window = window

    def first_key(self, seq: Sequence) -> int:
        first = max(0, seq.num_computed_tokens - self.window + 1)
        assert first >= seq.num_released_blocks * BS, "a query's window reaches a given-back block"
        return first


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(10, 24), st.sampled_from([4, 8, 16]), st.integers(1, 4), st.booleans(),
       st.sampled_from([1, 5, 8]))
def test_random_interleavings_with_a_window_read_only_their_own_window(ops, num_blocks, budget, max_seqs, caching,
                                                                       window):
    kv = KVCacheManager(num_blocks, BS, caching, sliding_window=window)
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    model = WindowedFakeModel(kv, window)
    requests = drive(ops, sched, model, 4 * num_blocks * BS, extra_tokens=24, settle_steps=4000)
    for request in requests:
        assert request.finished
    assert kv.pool.num_free == num_blocks - (kv.cache.num_cached_blocks if kv.cache else 0)


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def windowed(request, tmp_path_factory):
    build = {"mistral": build_tiny_mistral, "phi3": build_tiny_phi3}[request.param]
    return build(tmp_path_factory.mktemp(request.param), sliding_window=WINDOW)


def _engine(path, num_blocks: int, caching: bool, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK, max_num_batched_tokens=16,
               kv_cache_memory=num_blocks * BLOCK_BYTES, enable_prefix_caching=caching, **kwargs)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, int, int]:
    """Outputs, and the most blocks sequences referenced / the pool had out in any step."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals, most_used, most_taken = {}, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        most_used = max(most_used, engine.kv.pool.num_used)
        most_taken = max(most_taken, engine.kv.pool.num_blocks - engine.kv.pool.num_free)
    return [finals[str(i)] for i in range(len(prompts))], most_used, most_taken


PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12, 64, 65]


def _assert_greedy_under_hf(hf_model, prompts: list[list[int]], outputs) -> None:
    """Every generated token (EOS included: the runs ignore it) is transformers' greedy choice
    given the same sequence so far, and its logprob agrees."""
    for prompt, output in zip(prompts, outputs):
        for choice in output.outputs:
            ids = prompt + choice.token_ids
            with torch.no_grad():
                logprobs = hf_model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            for step, (token, ours) in enumerate(zip(choice.token_ids, choice.logprobs)):
                ref = logprobs[step]
                assert abs(ours[token].logprob - float(ref[token])) < 1e-4, f"step {step}: logprob differs"
                assert float(ref.max() - ref[token]) < 1e-3, f"step {step}: {token} is not transformers' choice"


@pytest.mark.parametrize("caching", [False, True])
def test_long_decode_holds_only_its_window(windowed, caching):
    """100 tokens after a 12-token prompt (112 positions, 28 blocks) in a pool of 12 blocks."""
    path, hf_model = windowed
    llm = _engine(path, 12, caching)
    assert llm.engine.kv.sliding_window == WINDOW and llm.engine.max_model_len >= 112
    outputs, most_used, most_taken = _run(llm, [PROMPT], SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY))
    assert most_used <= WINDOW // BLOCK + 2
    # with the cache: what the sequence inserted before it gave a block back (its 3 prompt blocks)
    assert most_taken <= WINDOW // BLOCK + 2 + (3 if caching else 0)
    assert len(outputs[0].outputs[0].token_ids) == 100
    _assert_greedy_under_hf(hf_model, [PROMPT], outputs)
    assert llm.engine.kv.pool.num_used == 0


def test_given_back_blocks_are_never_cache_hits(windowed):
    """A prefix-cached engine, the pool smaller than the sequences: a request past the cached
    prompt of a finished long generation, the same prompt again, and three long generations at
    once (evicting cached blocks as they go) all equal transformers."""
    path, hf_model = windowed
    llm = _engine(path, 12, caching=True)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    first, _, _ = _run(llm, [PROMPT], params)
    longer = PROMPT + first[0].outputs[0].token_ids[:30]
    again, _, _ = _run(llm, [longer, PROMPT], params)
    assert again[0].num_cached_tokens == 12 and again[1].num_cached_tokens == 8   # the prompt's blocks only
    assert again[1].outputs[0].token_ids == first[0].outputs[0].token_ids
    _assert_greedy_under_hf(hf_model, [longer, PROMPT], again)
    prompts = [PROMPT, PROMPT[::-1], [7] * 20]
    together, most_used, _ = _run(llm, prompts, SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY))
    assert most_used <= 12
    _assert_greedy_under_hf(hf_model, prompts, together)
    pool = llm.engine.kv.pool
    assert pool.num_used == 0 and pool.num_free + llm.engine.kv.cache.num_cached_blocks == pool.num_blocks


def test_forked_completions_of_a_prompt_longer_than_the_window(windowed):
    """n=2 after a 30-token prompt prefilled in chunks of 16: the second completion forks from
    the first's prompt blocks, the ones behind the window already given back."""
    path, hf_model = windowed
    prompt = list(range(40, 70))
    outputs, _, _ = _run(_engine(path, 16, caching=False), [prompt],
                         SamplingParams(n=2, max_tokens=20, ignore_eos=True, **GREEDY))
    first, second = (choice.token_ids for choice in outputs[0].outputs)
    assert first == second
    _assert_greedy_under_hf(hf_model, [prompt], outputs)


def test_interleaved_global_layers_keep_their_blocks(tmp_path):
    """Gemma 2's global layers read every position: no block is given back (the bound then is
    the context, as without a window)."""
    path, _ = build_tiny_gemma2(tmp_path)
    llm = _engine(path, 64, caching=False)
    assert llm.engine.kv.sliding_window is None
    _, most_used, _ = _run(llm, [PROMPT], SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    assert most_used == 13   # ceil(52 / 4)
