"""W8A8 int8 against bf16, engine level (no HTTP), both engines in one process, alternating:
the embedded model as loaded (bf16) and the same weights with `--quantization int8` (int8
per output channel, activations int8 per token at run time: the compute of a W8A8-int8
checkpoint). Random prompts, all in flight at once (c=32 by default); rounds go bf16, int8,
int8, bf16, ... (ABBA), so drift on a shared machine cancels. Reported per arm and round: output
tok/s over the whole run, and the prefill (the steps before the first decode) in ms.

    python benchmarks/int8_ab.py [--rounds 4] [--num-prompts 32] [--input-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.llm_engine import LLMEngine
from kubeinfer.server.engine.sampling_params import SamplingParams


def load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def run(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, float]:
    """(output tok/s, seconds until every request had its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", engine.make_request(f"{tag}-{i}", prompt, params))
    prefilled = None
    while engine.has_unfinished_requests():
        engine.step()
        if prefilled is None and not engine.scheduler.waiting and all(
                seq.num_output_tokens for seq in engine.scheduler.running):
            prefilled = time.perf_counter() - start
    return len(prompts) * output_len / (time.perf_counter() - start), prefilled or 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    engines = {name: LLMEngine(EngineConfig(model=args.model, kv_cache_memory=1 << 30, quantization=quantization))
               for name, quantization in (("bf16", "none"), ("int8", "int8"))}
    config = engines["bf16"].model_config
    rng = random.Random(0)
    special = set(engines["bf16"].tokenizer.all_special_ids)
    vocab = [t for t in range(config.vocab_size) if t not in special]
    prompts = [[rng.choice(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    for name, engine in engines.items():   # packs the int8 panels, warms both at full batch
        run(engine, prompts, 8, f"warmup-{name}")
    print(f"{args.num_prompts} prompts {args.input_len}/{args.output_len}, all in flight; load {load()}")
    ratios, prefill_ratios = [], []
    for round_ in range(args.rounds):
        order = ("bf16", "int8") if round_ % 2 == 0 else ("int8", "bf16")
        figures = {}
        for name in order:
            before = load()
            figures[name] = run(engines[name], prompts, args.output_len, f"{round_}-{name}")
            print(f"round {round_ + 1} {name}: {figures[name][0]:7.1f} output tok/s, prefill "
                  f"{figures[name][1] * 1000:6.0f} ms  (load {before})", flush=True)
        ratios.append(figures["int8"][0] / figures["bf16"][0])
        prefill_ratios.append(figures["int8"][1] / figures["bf16"][1])
        print(f"round {round_ + 1} int8/bf16: {ratios[-1]:.3f} tok/s, prefill time {prefill_ratios[-1]:.3f}",
              flush=True)
    mean = math.prod(ratios) ** (1 / len(ratios))
    print(f"int8/bf16 output tok/s over {len(ratios)} rounds: geometric mean {mean:.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; prefill time {math.prod(prefill_ratios) ** (1 / len(prefill_ratios)):.3f}; "
          f"load {load()}", flush=True)


if __name__ == "__main__":
    main()
