"""What a prompt-logprobs request costs against a plain one on a warm prefix cache: the cached
prefix is recomputed and the prompt positions' logits computed (`server/engine/prompt_logprobs.py`).
Engine-level, one request at a time, median of `--repeats`.

    python benchmarks/prompt_logprobs_cost.py [--model embedded] [--prefix 448] [--suffix 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix", type=int, default=448)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=True, kv_cache_memory=256 << 20)
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, vocab - 100, (args.prefix,), generator=generator).tolist()

    def prompt() -> list[int]:
        return prefix + torch.randint(100, vocab - 100, (args.suffix,), generator=generator).tolist()

    llm.generate([prompt()], SamplingParams(max_tokens=1))   # warms the prefix and the kernels
    rows = {}
    for name, params in (("plain, prefix cached", SamplingParams(max_tokens=1)),
                         ("prompt_logprobs=0, prefix recomputed", SamplingParams(max_tokens=1, prompt_logprobs=0)),
                         ("prompt_logprobs=5, prefix recomputed", SamplingParams(max_tokens=1, prompt_logprobs=5))):
        times, cached = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            output = llm.generate([prompt()], params)[0]
            times.append(time.perf_counter() - start)
            cached.append(output.num_cached_tokens)
        rows[name] = (statistics.median(times), statistics.median(cached))
    bytes_kv = llm.engine.runner.kv_caches[0].k[0].numel() * llm.engine.runner.kv_caches[0].k.itemsize * 2 * len(
        llm.engine.runner.kv_caches) / llm.engine.runner.block_size
    print(f"model {args.model} {args.dtype}, prompt {args.prefix}+{args.suffix} tokens, {torch.get_num_threads()} threads")
    for name, (seconds, cached) in rows.items():
        print(f"  {name:40s} {seconds * 1000:8.1f} ms  (cached tokens {cached:.0f})")
    print(f"  K/V per token {bytes_kv / 1024:.1f} KiB; float32 logits per position {vocab * 4 / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
