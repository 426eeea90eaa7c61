"""The decode-graph runner's static buffers and padding (`server/engine/cuda_graphs.py`), on this
CPU: every op on its Triton kernel (interpreted), each captured size "recorded" as an eager
forward pass over the same static buffers, so what a replay reads is exactly what the CUDA
graph would. Capture itself is checked on a GPU (`tests/gpu`).
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine_runs import generate_tokens
from helpers.tiny_models import make_tiny_llama

from kubeinfer.kernels import ops
from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.cuda_graphs import DecodeGraphs, why_not_graphed
from kubeinfer.server.engine.llm_engine import LLMEngine
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.model.layers.attention_triton import TritonAttention

pytestmark = pytest.mark.integration


class EagerDecodeGraphs(DecodeGraphs):
    """Replays run the forward pass on the static buffers instead of a captured graph."""

    replays: list[int]

    def _record(self, batch):
        logits = self.model(batch, self.kv_caches).clone()

        def replay() -> None:
            self.replays.append(batch.num_tokens)
            logits.copy_(self.model(batch, self.kv_caches))
        return replay, logits


def _generate(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return generate_tokens(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
                                             for length in lengths])


def test_padded_decode_replays_give_the_eager_tokens(tmp_path):
    """Three sequences finishing at different steps replay the sizes 4, 2 and 1 (padded from 3,
    2 and 1), with a prefill step between replays; tokens equal the torch path's."""
    path = str(make_tiny_llama(tmp_path))
    prompts = [list(range(10, 31)), list(range(40, 45)), list(range(60, 97))]
    lengths = [9, 5, 13]
    config = EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=5)
    want = _generate(LLMEngine(config), prompts, lengths)

    engine = LLMEngine(config)
    for layer in engine.runner.model.model.layers:
        layer.self_attn.backend = TritonAttention()
    graphs = EagerDecodeGraphs(engine.runner.model, engine.runner.kv_caches, max_num_seqs=5,
                               max_model_len=engine.max_model_len, block_size=16,
                               num_blocks=engine.runner.num_blocks, device=torch.device("cpu"))
    assert graphs.sizes == [1, 2, 4, 5]
    graphs.replays = []
    with ops.use_backend("triton"):
        graphs.capture()
        engine.runner.graphs = graphs
        got = _generate(engine, prompts, lengths)
        late = _generate(engine, [list(range(5, 25))], [3])   # the buffers hold the last step's leftovers
    assert got == want
    assert late == _generate(LLMEngine(config), [list(range(5, 25))], [3])
    assert set(graphs.replays) == {4, 2, 1} and len(graphs.replays) == 12 + 2   # one decode step per token after the first
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total


@pytest.mark.parametrize("settings, reason", [
    (dict(enforce_eager=True), "--enforce-eager"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(calculate_kv_scales=True), "--calculate-kv-scales"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
])
def test_what_keeps_decode_eager_is_named(settings, reason, tmp_path):
    model = LLMEngine(EngineConfig(model=str(make_tiny_llama(tmp_path)), device="cpu", dtype="float32",
                                   kv_cache_memory=4 << 20)).runner.model
    for layer in model.model.layers:
        layer.self_attn.backend = TritonAttention()
    flags = dict(enforce_eager=False, enable_lora=False, calculate_kv_scales=False, tensor_parallel_size=1)
    assert why_not_graphed(model, device=torch.device("cpu"), **flags) == "not on CUDA"
    assert why_not_graphed(model, device=torch.device("cuda"), **flags) is None
    assert reason in why_not_graphed(model, device=torch.device("cuda"), **{**flags, **settings})


def test_a_forward_that_cannot_be_captured_leaves_decode_eager(tmp_path, monkeypatch, caplog):
    """Capture raising (as a host sync inside a layer does under CUDA capture) is logged, and the
    engine serves every step eagerly instead of failing to start."""
    from kubeinfer.server.engine import model_runner

    def refuse(self, batch):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner, "why_not_graphed", lambda *args, **kwargs: None)
    monkeypatch.setattr(model_runner, "why_not_cpu_graphed", lambda *args, **kwargs: "the CUDA path is under test")
    monkeypatch.setattr(DecodeGraphs, "_record", refuse)
    path = str(make_tiny_llama(tmp_path))
    config = EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory=4 << 20)
    engine = LLMEngine(config)
    assert engine.runner.graphs is None
    assert "capturing them in CUDA graphs failed: operation not permitted" in caplog.text
    monkeypatch.undo()
    prompts = [list(range(10, 31)), list(range(40, 45))]
    assert _generate(engine, prompts, [6, 4]) == _generate(LLMEngine(config), prompts, [6, 4])
