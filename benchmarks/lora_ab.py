"""Multi-LoRA cost, engine level (no HTTP), alternating on one engine: random 128/128 with all
requests in flight at once (c=32), spread over 4 rank-16 adapters (all seven projections of
every layer), against the same prompts on the base model. Rounds go base, LoRA, LoRA, base, ...
(ABBA), so drift on a shared machine cancels; then the time to read and register an adapter
and to fill its device slot.

    python benchmarks/lora_ab.py [--rounds 2] [--num-prompts 32] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from pathlib import Path

from lora_adapters import write_adapter

from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.llm_engine import LLMEngine
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.flags import LoRAModuleSpec


def load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], output_len: int, tag: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        request_id = f"{tag}-{i}"
        engine.add_request(request_id, engine.make_request(request_id, prompt, params, adapter=adapter))
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * output_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lora-ab-"))
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_memory=2 << 30, enable_lora=True, max_loras=4,
                                    max_lora_rank=args.rank))
    config = engine.model_config
    names = [f"lora{i}" for i in range(5)]
    for i, name in enumerate(names):
        write_adapter(root / name, config, args.rank, i, args.model)
    timings = []
    for name in names[:4]:
        start = time.perf_counter()
        module = LoRAModuleSpec(name, str(root / name))
        engine.adapters.register(module, engine.adapters.read(module), engine.scheduler)
        timings.append(time.perf_counter() - start)
    rng = random.Random(0)
    special = set(engine.tokenizer.all_special_ids)
    vocab = [t for t in range(config.vocab_size) if t not in special]
    prompts = [[rng.choice(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    spread = [names[i % 4] for i in range(args.num_prompts)]
    # fills the 4 slots and warms both arms at full batch (the first large batch after start is slower)
    run(engine, prompts, spread, 8, "warmup-lora")
    run(engine, prompts, [None] * len(prompts), 8, "warmup-base")
    print(f"dtype {engine.loaded.dtype}, {args.num_prompts} prompts {args.input_len}/{args.output_len}, "
          f"adapters rank {args.rank} on all 7 projections")
    ratios = []
    for round_ in range(args.rounds):
        order = ("base", "lora") if round_ % 2 == 0 else ("lora", "base")
        figures = {}
        for kind in order:
            before = load()
            figures[kind] = run(engine, prompts, [None] * len(prompts) if kind == "base" else spread, args.output_len,
                                f"{round_}-{kind}")
            print(f"round {round_ + 1} {kind:4s}: {figures[kind]:7.1f} output tok/s  (load {before})", flush=True)
        ratios.append(figures["lora"] / figures["base"])
        print(f"round {round_ + 1} lora/base: {ratios[-1]:.3f}", flush=True)
    print(f"lora/base over {len(ratios)} rounds: geometric mean {math.prod(ratios) ** (1 / len(ratios)):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}", flush=True)
    module = LoRAModuleSpec(names[4], str(root / names[4]))
    start = time.perf_counter()
    weights = engine.adapters.read(module)
    read = time.perf_counter() - start
    engine.adapters.register(module, weights, engine.scheduler)
    start = time.perf_counter()
    engine.adapters.manager.activate(names[4], (), set())   # evicts the LRU slot and fills it
    fill = time.perf_counter() - start
    print(f"adapter read+check {read * 1000:.0f} ms (register of the first four: "
          f"{', '.join(f'{t * 1000:.0f}' for t in timings)} ms), slot fill {fill * 1000:.0f} ms; "
          f"{weights.num_bytes / 2**20:.1f} MiB; load {load()}")


if __name__ == "__main__":
    main()
