"""Speculative decoding scores a decoding sequence's drafts as a short extend (1 + k queries over
its cached context). Which attention path takes those queries, and that it is right:
- Triton (interpreted here): the unified kernel, any query count; greedy output with n-gram
  drafts equals the torch path's without drafts (fp32).
- CPU, bf16 with AMX: the C prefill kernel reads the context in place (not the padded torch
  fallback, which gathers the whole context per layer); greedy output unchanged on the
  embedded model.
- CPU fp32 (or without AMX): the padded torch path, checked token for token by
  tests/engine/test_spec_decode.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_tiny_llama

from kubeinfer.kernels import ops
from kubeinfer.kernels.cpu import paged_prefill_cpu
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.model.layers.attention import TorchAttention
from kubeinfer.server.model.layers.attention_triton import TritonAttention
from kubeinfer.server.model.loader import load_model

pytestmark = pytest.mark.integration

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts() -> list[list[int]]:
    return [[11, 12, 13, 14, 15] * 3 + [16, 17], [40, 41, 42, 43] * 4 + [44]]


def test_triton_attention_verifies_drafts_as_the_torch_path_decodes(tmp_path):
    path = str(make_tiny_llama(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(loaded_model=load_model(path, dtype="float32", device="cpu"), block_size=4,
               kv_cache_memory=1 << 20).generate(_prompts(), params)
    loaded = load_model(path, dtype="float32", device="cpu")
    for layer in loaded.model.model.layers:
        layer.self_attn.backend = TritonAttention()
    llm = LLM(loaded_model=loaded, block_size=4, kv_cache_memory=1 << 20, speculative_config=NGRAM)
    with ops.use_backend("triton"):
        got = llm.generate(_prompts(), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def embedded_bf16():
    if not paged_prefill_cpu.available(torch.bfloat16, 64):
        pytest.skip("the C prefill kernel needs AMX and bf16 (the padded torch path serves instead)")
    return load_model("embedded", dtype="bfloat16", device="cpu")


def test_cpu_verify_steps_take_the_prefill_kernel_not_the_padded_fallback(embedded_bf16, monkeypatch):
    calls: dict[str, list[list[int]]] = {"prefill": [], "padded": [], "decode": []}
    for name in calls:
        original = getattr(TorchAttention, f"_{name}")

        def spy(*args, _name=name, _original=original, **kwargs):
            group = next(a for a in args if hasattr(a, "rows") and hasattr(a, "block_tables")
                         or hasattr(a, "key_mask"))
            query_lens = getattr(group, "query_lens", None)
            calls[_name].append(query_lens.tolist() if query_lens is not None else [])
            return _original(*args, **kwargs)
        monkeypatch.setattr(TorchAttention, f"_{name}", staticmethod(spy) if name == "prefill" else spy)
    text = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
            "The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(loaded_model=embedded_bf16, kv_cache_memory=64 << 20).generate([text], params)
    calls.update(prefill=[], padded=[], decode=[])
    llm = LLM(loaded_model=embedded_bf16, kv_cache_memory=64 << 20, speculative_config=NGRAM)
    [out] = llm.generate([text], params)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    verify = [lens for lens in calls["prefill"] if lens and 1 < max(lens) <= 1 + NGRAM["num_speculative_tokens"]]
    assert verify and not calls["padded"]
