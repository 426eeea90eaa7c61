"""The naive baseline: transformers `generate` on static batches of the bench's datasets (the
same seeded token ids as `kubeinfer bench serve`), bf16 on the CPU.

A level of concurrency c runs the prompts in consecutive batches of c, as a static-batching
server would for c closed-loop clients: every request of a batch starts with it, gets its first
token after the batch's prefill and its last when the whole batch ends. The timestamps come
from a stopping criterion called once per generated token, and go through the bench's own
summary, so the JSON and the table have the same fields as the served engines'.

    python benchmarks/hf_generate.py HF_DIR --dataset random --concurrency 1,4,16,32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, StoppingCriteria

from kubeinfer.server.bench.serve_client import RequestResult
from kubeinfer.server.bench.serve_datasets import DatasetConfig, build_dataset
from kubeinfer.server.bench.serve_report import LevelReport, format_table, summarize


class TokenClock(StoppingCriteria):
    """Records when each decode step's tokens exist; never stops generation."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_batch(model: PreTrainedModel, batch: list[list[int]], output_len: int) -> list[RequestResult]:
    """One static batch (equal-length prompts, no padding); greedy, exactly output_len tokens."""
    clock = TokenClock()
    inputs = torch.tensor(batch)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, stopping_criteria=[clock],
                             pad_token_id=model.generation_config.eos_token_id)
    end = time.perf_counter()
    generated = out.shape[1] - inputs.shape[1]
    itl = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return [RequestResult(ok=True, prompt_tokens=len(prompt), output_tokens=generated, ttft=clock.times[0] - start,
                          e2e=end - start, itl=itl) for prompt in batch]


def run_level(model: PreTrainedModel, prompts: list[list[int]], batch_size: int, output_len: int,
              max_duration: float) -> LevelReport:
    """Batches of batch_size until the prompts run out; none starts after max_duration."""
    results: list[RequestResult] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        if time.perf_counter() - start > max_duration:
            break
        results += run_batch(model, prompts[i:i + batch_size], output_len)
    return summarize(results, time.perf_counter() - start, batch_size, float("inf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="Hugging Face model directory")
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--concurrency", default="1,4,16,32", help="static batch sizes, comma-separated")
    parser.add_argument("--max-duration", type=float, default=600.0, help="seconds per level before no batch starts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--label", default=None)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    def prompts_for(concurrency: int) -> list[list[int]]:
        """The prompts `kubeinfer bench serve` sends at this level (seed 0 + concurrency)."""
        config = DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, num_groups=args.num_groups, prefix_len=args.prefix_len,
                               seed=concurrency)
        prompts = [request.prompt for request in build_dataset(config)]
        assert all(isinstance(p, list) and len(p) == len(prompts[0]) for p in prompts), "static batches need equal lengths"
        return prompts

    prompts = prompts_for(0)
    run_batch(model, prompts[:2], 8)  # warm-up, like the bench's warm-up requests
    label = args.label or f"transformers {args.dataset}"
    print(f"{label}: {len(prompts)} prompts, input {len(prompts[0])}, output {args.output_len}, "
          f"{args.threads} threads", flush=True)
    reports = []
    for batch_size in (int(c) for c in args.concurrency.split(",")):
        reports.append(run_level(model, prompts_for(batch_size), batch_size, args.output_len, args.max_duration))
        print(f"  batch {batch_size}: {reports[-1].output_throughput:.1f} out tok/s", file=sys.stderr, flush=True)
        if args.json_path:  # after every level: a slow sweep that is cut short keeps what it measured
            with open(args.json_path, "w") as handle:
                json.dump({"label": label, "config": vars(args), "levels": [r.to_json() for r in reports]}, handle,
                          indent=2)
    print(format_table(reports))


if __name__ == "__main__":
    main()
