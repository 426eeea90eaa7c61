"""CPU decode steps replayed from recorded kernel calls (`server/engine/cpu_graphs.py`): the same
tokens and logprobs as eager steps, sizes whose layers run torch ops left eager, and the guard
that tells them apart."""

from __future__ import annotations

import pytest
import torch
from helpers.quantized_models import quantize_compressed_tensors
from helpers.tiny_models import build_tiny_llama, make_tiny_gemma2, make_tiny_llama

from kubeinfer.kernels.cpu import int8_linear_cpu
from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.cpu_graphs import CpuDecodeGraphs, RecordingRefused, _OnlyKernels, why_not_graphed
from kubeinfer.server.engine.llm_engine import LLMEngine
from kubeinfer.server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

W8A8 = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True}}
PROMPTS = [list(range(10, 31)), list(range(40, 45)), list(range(60, 97)), [5, 6, 7], list(range(100, 117))]
LENGTHS = [9, 5, 13, 2, 11]
LATE = ([list(range(200, 209)), list(range(7, 40))], [6, 4])   # added after the third step


@pytest.fixture(scope="module")
def w8a8_llama(tmp_path_factory):
    if not int8_linear_cpu.available():
        pytest.skip("the int8 kernel needs AVX512-VNNI and AVX512-BF16")
    folder = tmp_path_factory.mktemp("w8a8")
    path, hf_model = build_tiny_llama(folder)
    return quantize_compressed_tensors(path, hf_model, W8A8, folder / "w8a8")[0]


def _engine(path, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory=8 << 20, max_num_seqs=8,
                                  **settings))


def _run(engine: LLMEngine) -> dict[str, tuple[list[int], list]]:
    """Five requests of different lengths, two more after the third step (a prefill step between
    decode steps, and batch sizes that shrink and grow): each one's tokens and logprobs."""
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)  # noqa: E731
    for i, (prompt, length) in enumerate(zip(PROMPTS, LENGTHS)):
        engine.add_request(f"r{i}", prompt, params(length))
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 3:
            for i, (prompt, length) in enumerate(zip(*LATE)):
                engine.add_request(f"late{i}", prompt, params(length))
        steps += 1
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outputs[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    return outputs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_replayed_decode_steps_give_the_eager_tokens_and_logprobs(w8a8_llama, kv_cache_dtype, monkeypatch):
    want = _run(_engine(w8a8_llama, enforce_eager=True, kv_cache_dtype=kv_cache_dtype))
    replays: list[int] = []
    replay = CpuDecodeGraphs._replay

    def counted(self, recorded, size):
        replays.append(size)
        replay(self, recorded, size)

    monkeypatch.setattr(CpuDecodeGraphs, "_replay", counted)
    engine = _engine(w8a8_llama, kv_cache_dtype=kv_cache_dtype)
    graphs = engine.runner.graphs
    assert isinstance(graphs, CpuDecodeGraphs)
    assert _run(engine) == want
    assert not graphs.refused and len(graphs.recorded) >= 3
    assert 1 in graphs.recorded   # one row's k/v views differ in their row stride: the store kernel takes them
    assert set(replays) <= set(graphs.recorded) and len(replays) >= 5
    stats = engine.stats()
    assert stats.num_blocks_free + stats.num_blocks_evictable == stats.num_blocks_total


def test_a_size_whose_layers_run_torch_ops_stays_eager_naming_the_op(tmp_path, caplog):
    """Unquantized float32 linears are torch's: every size is refused at its first step, which still
    returns the eager step's tokens, and is not tried again."""
    path = make_tiny_llama(tmp_path)
    want = _run(_engine(path, dtype="float32", enforce_eager=True))
    engine = _engine(path, dtype="float32")
    caplog.set_level("INFO", logger="kubeinfer.server.engine.cpu_graphs")
    assert _run(engine) == want
    graphs = engine.runner.graphs
    assert graphs.refused and not graphs.recorded
    assert "run eagerly: the decoder layers run aten.linear" in caplog.text
    assert not any(graphs.fits([1] * size, 1) for size in graphs.refused)


def test_the_guard_allows_allocations_and_views_only():
    x = torch.randn(4, 6)
    guard = _OnlyKernels()
    with guard:
        fresh = torch.empty(4, 6)
        views = [x.view(24), x[1:], x.reshape(2, 12), x.to(torch.float32), *x.split([2, 4], dim=1)]
    assert all(view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for view in views)
    assert any(kept is fresh for kept in guard.tensors)
    for computes in (lambda: x + 1, lambda: x.add_(1), lambda: x.t().contiguous(), lambda: x.sum().item(),
                     lambda: x.to(torch.bfloat16), lambda: x.index_select(0, torch.tensor([0]))):
        with pytest.raises(RecordingRefused, match="the decoder layers run aten"), _OnlyKernels():
            computes()


def test_a_failing_kernel_in_a_replay_raises_naming_it(w8a8_llama):
    engine = _engine(w8a8_llama)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    recorded = engine.runner.graphs.recorded[1]

    def out_of_memory(*args: object) -> int:
        return 3

    function, args = recorded.calls[5]
    recorded.calls[5] = (out_of_memory, args)
    with pytest.raises(RuntimeError, match="out_of_memory failed in a recorded decode step \\(status 3\\)"):
        engine.step()


@pytest.mark.parametrize("settings, reason", [
    (dict(enforce_eager=True), "--enforce-eager"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(calculate_kv_scales=True), "--calculate-kv-scales"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
])
def test_what_keeps_cpu_decode_eager_is_named(settings, reason, tmp_path):
    model = _engine(make_tiny_llama(tmp_path), dtype="float32").runner.model
    flags = dict(enforce_eager=False, enable_lora=False, calculate_kv_scales=False, tensor_parallel_size=1)
    assert why_not_graphed(model, device=torch.device("cpu"), **flags) is None
    assert reason in why_not_graphed(model, device=torch.device("cpu"), **{**flags, **settings})
    assert why_not_graphed(model, device=torch.device("cuda"), **flags) == "not on the CPU"
    gemma = _engine(make_tiny_gemma2(tmp_path), dtype="float32")
    assert gemma.runner.graphs is None
    assert why_not_graphed(gemma.runner.model, device=torch.device("cpu"), **flags) == \
        "a model family with its own forward pass"


def test_sizes_past_the_memory_budget_stay_eager(w8a8_llama, monkeypatch, caplog):
    from kubeinfer.server.engine import cpu_graphs

    want = _run(_engine(w8a8_llama, enforce_eager=True))
    engine = _engine(w8a8_llama)
    one_row = engine.runner.model.config.hidden_size * 2 * 4   # less than a layer's activations of a row
    monkeypatch.setattr(cpu_graphs, "RECORDED_BYTES", one_row)
    caplog.set_level("INFO", logger="kubeinfer.server.engine.cpu_graphs")
    assert _run(engine) == want
    graphs = engine.runner.graphs
    assert graphs.refused and not graphs.recorded and graphs.held_bytes == 0
    assert "more than the recorded sizes may" in caplog.text


def test_no_size_is_recorded_while_a_kernel_still_compiles(w8a8_llama, monkeypatch):
    """A starting server's layers take torch's path until its kernels are built: recording then
    would refuse the size for good."""
    from kubeinfer.kernels.cpu import cpu_build

    engine = _engine(w8a8_llama)
    monkeypatch.setattr(cpu_build, "building", lambda name: name == "paged_decode_cpu")
    graphs = engine.runner.graphs
    assert not graphs.fits([1, 1, 1], 2)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert not graphs.recorded and not graphs.refused
    monkeypatch.undo()
    assert graphs.fits([1, 1, 1], 2)
