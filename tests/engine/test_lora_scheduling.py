"""How the engine schedules LoRA requests: device slots as an LRU never taken from an adapter
with running requests (its requests wait, others go on), unloading with requests in flight,
adapters re-read from disk past --max-cpu-loras, and the running/waiting adapters in stats."""

from __future__ import annotations

import pytest
from helpers.lora_adapters import make_peft_adapter
from helpers.tiny_models import build_tiny_llama

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import InvalidRequestError, SamplingParams
from kubeinfer.server.flags import LoRAModuleSpec
from kubeinfer.server.model.adapters.lora import LoRAError

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 250, 33, 90, 91, 92, 7, 300, 12]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sched")
    base, _ = build_tiny_llama(root / "base")
    modules = [LoRAModuleSpec(name, str(make_peft_adapter(base, root / name, rank=8, targets=targets, seed=i)[0]))
               for i, (name, targets) in enumerate([("x", ["q_proj", "v_proj"]), ("y", ["down_proj"]),
                                                    ("z", ["o_proj"])])]
    return base, modules


def _llm(lora_setup, **kwargs) -> LLM:
    base, modules = lora_setup
    kwargs.setdefault("lora_modules", modules)
    return LLM(str(base), dtype="float32", kv_cache_memory=4 << 20, enable_lora=True, **kwargs)


def _run(llm: LLM, requests: list[tuple[str, str | None]], on_step=None) -> dict[str, list[int]]:
    engine = llm.engine
    for request_id, adapter in requests:
        engine.add_request(request_id, engine.make_request(request_id, PROMPT, PARAMS, adapter=adapter))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.error is None
                tokens[output.request_id] = output.outputs[0].token_ids
        if on_step is not None:
            on_step(engine)
    return tokens


def test_one_slot_runs_one_adapter_at_a_time_and_the_base_never_waits(lora_setup):
    llm = _llm(lora_setup, max_loras=1)
    alone = {name: llm.generate([PROMPT], PARAMS, adapter=name)[0].outputs[0].token_ids for name in ("x", "y", None)}
    seen: list[set] = []

    def check(engine):
        running = {seq.request.adapter for seq in engine.scheduler.running}
        seen.append(running)
        assert len(running - {None}) <= 1   # one slot: never two adapters in a step

    order = [("x1", "x"), ("y1", "y"), ("b1", None), ("x2", "x"), ("y2", "y"), ("b2", None)]
    tokens = _run(llm, order, check)
    assert {request_id: tokens[request_id] for request_id, _ in order} == {
        request_id: alone[adapter] for request_id, adapter in order}
    assert {None, "x"} <= seen[0]   # the base requests ran in the first step next to x's
    kv = llm.engine.kv
    assert kv.pool.num_free + kv.num_evictable_blocks == kv.pool.num_blocks


def test_stats_list_running_and_waiting_adapters(lora_setup):
    llm = _llm(lora_setup, max_loras=1)
    engine = llm.engine
    for request_id, adapter in (("1", "x"), ("2", "y")):
        engine.add_request(request_id, engine.make_request(request_id, PROMPT, PARAMS, adapter=adapter))
    engine.step()
    stats = engine.stats()
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, ("x",), ("y",))


def test_unloading_an_adapter_in_use_lets_its_requests_finish(lora_setup):
    llm = _llm(lora_setup, max_loras=2)
    expected = llm.generate([PROMPT], PARAMS, adapter="x")[0].outputs[0].token_ids
    engine = llm.engine
    unloaded = []

    def unload_after_first_step(engine):
        if not unloaded:
            engine.adapters.unregister("x", engine.scheduler)
            unloaded.append(True)
            with pytest.raises(InvalidRequestError) as refused:
                engine.make_request("late", PROMPT, PARAMS, adapter="x")
            assert refused.value.code == "model_not_found"
            with pytest.raises(LoRAError, match="still serves requests"):
                engine.adapters.register(lora_setup[1][0], engine.adapters.read(lora_setup[1][0]), engine.scheduler)

    tokens = _run(llm, [("running", "x"), ("waiting", "x"), ("other", "y")], unload_after_first_step)
    assert tokens["running"] == tokens["waiting"] == expected
    # once they are done the name is free again, and the slot is reused
    engine.adapters.register(lora_setup[1][0], engine.adapters.read(lora_setup[1][0]), engine.scheduler)
    assert llm.generate([PROMPT], PARAMS, adapter="x")[0].outputs[0].token_ids == expected


def test_adapters_past_max_cpu_loras_are_read_again(lora_setup):
    llm = _llm(lora_setup, max_loras=1, max_cpu_loras=1)
    first = {name: llm.generate([PROMPT], PARAMS, adapter=name)[0].outputs[0].token_ids for name in "xyz"}
    assert len(llm.engine.adapters.manager._cpu) == 1
    assert {name: llm.generate([PROMPT], PARAMS, adapter=name)[0].outputs[0].token_ids for name in "zyx"} == first
