"""`kubeinfer bench throughput`: offline engine throughput, no HTTP (vLLM's `bench throughput`).

Prompts are random token ids from a fixed seed and every request generates exactly
`--output-len` tokens (ignore_eos), so runs compare like for like.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from ..flags import ENGINE_FLAGS, add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default="random",
                        help="shared-prefix: every prompt starts with the same --prefix-len tokens.")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128,
                        help="Prompt tokens (after the shared prefix, for shared-prefix).")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON here.")
    add_flags(parser, ENGINE_FLAGS)


def make_prompts(args: argparse.Namespace, vocab_size: int, avoid: frozenset[int]
                 ) -> list[list[int]]:
    rng = random.Random(args.dataset_seed)
    choices = [t for t in range(vocab_size) if t not in avoid]

    def tokens(count: int) -> list[int]:
        return [rng.choice(choices) for _ in range(count)]

    prefix = tokens(args.prefix_len) if args.dataset == "shared-prefix" else []
    return [prefix + tokens(args.input_len) for _ in range(args.num_prompts)]


def run(args: argparse.Namespace) -> int:
    from ..engine.config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_args(args))
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    prompts = make_prompts(args, vocab, frozenset(engine.tokenizer.all_special_ids))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = args.num_prompts * args.output_len
    result = {
        "dataset": args.dataset, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else 0,
        "enable_prefix_caching": args.enable_prefix_caching,
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "wall_seconds": round(elapsed, 3),
        "requests_per_second": round(args.num_prompts / elapsed, 3),
        "output_tokens_per_second": round(output_tokens / elapsed, 2),
        "total_tokens_per_second": round((prompt_tokens + output_tokens) / elapsed, 2),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), 4),
        "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
    }
    for key, value in result.items():
        print(f"{key:28s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
