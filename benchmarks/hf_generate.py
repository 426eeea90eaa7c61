"""The naive baseline: transformers `generate` on static batches of the bench's random
dataset (same seeded token ids), bf16 on the CPU. A batch of size c stands in for c
concurrent users; output tok/s is generated tokens over wall time.

    python benchmarks/hf_generate.py HF_DIR --concurrency 1,4,16,32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from kubeinfer.server.bench.serve_datasets import DatasetConfig, build_dataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    prompts = [r.prompt for r in build_dataset(DatasetConfig(num_prompts=args.num_prompts, input_len=args.input_len,
                                                             output_len=args.output_len))]
    levels = []
    for batch_size in (int(c) for c in args.concurrency.split(",")):
        batches = [prompts[i:i + batch_size] for i in range(0, min(len(prompts), 2 * batch_size), batch_size)]
        start, generated, latencies = time.perf_counter(), 0, []
        for batch in batches:
            began = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(torch.tensor(batch), attention_mask=torch.ones(len(batch), len(batch[0]), dtype=torch.long),
                                     max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
            generated += (out.shape[1] - len(batch[0])) * len(batch)
            latencies += [time.perf_counter() - began] * len(batch)
        duration = time.perf_counter() - start
        level = {"concurrency": batch_size, "completed": sum(len(b) for b in batches), "duration_s": duration,
                 "output_throughput": generated / duration, "e2e_ms": {"p50": 1000 * sorted(latencies)[len(latencies) // 2]}}
        print(json.dumps(level))
        levels.append(level)
    if args.json_path:
        with open(args.json_path, "w") as handle:
            json.dump({"label": "transformers random 128/128", "levels": levels}, handle, indent=2)


if __name__ == "__main__":
    main()
