"""`kubeinfer bench serve`: load-test any OpenAI-compatible endpoint (kubeinfer, vLLM,
llama.cpp's llama-server) with a concurrency sweep and/or Poisson arrivals.

Every level is bounded by --num-prompts and --max-duration. Each level draws its own seeded
prompts (`level_seed`), the same for every engine: replaying one set at every level let the
later levels hit the prefix cache of the engines that have one, so their TTFT measured a cache
hit, not a prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict

import httpx
from tqdm import tqdm

from .serve_client import RequestResult, send_request
from .serve_datasets import BenchRequest, DatasetConfig, build_dataset
from .serve_report import LevelReport, format_table, plot, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="Server root, without /v1.")
    add("--endpoint", default=None, help="Default: /v1/chat/completions for --dataset chat and grounded, else /v1/completions.")
    add("--model", default=None, help="Model name to send (default: the first one /v1/models lists).")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key [env OPENAI_API_KEY].")
    add("--dataset", default="random", choices=("random", "shared-prefix", "chat", "grounded"))
    add("--corpus", default="benchmarks/corpus",
        help="grounded: a folder of .txt passages; each request asks to repeat, rewrite, extract from or "
             "summarise one (answers copy from the prompt). Use with --no-ignore-eos.")
    add("--num-prompts", type=int, default=64, help="Requests per level.")
    add("--input-len", type=int, default=128, help="Prompt tokens (shared-prefix: the distinct question).")
    add("--output-len", type=int, default=128, help="Tokens to generate per request.")
    add("--prompt-format", default="tokens", choices=("tokens", "text"),
        help="Token-id prompts (exact lengths) or word text (~1 token per word).")
    add("--token-range", default="1000,20000", help="Token ids are drawn from [low, high).")
    add("--num-groups", type=int, default=4, help="shared-prefix: groups sharing one prefix.")
    add("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each group's prefix.")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
        help="Generate exactly --output-len tokens (sends ignore_eos and min_tokens).")
    add("--lora-modules", nargs="+", default=None, metavar="NAME",
        help="LoRA adapters the server serves (as vLLM's benchmark): measured requests name them in turn as "
             "their model, spreading the load evenly over them.")
    add("--extra-body", type=json.loads, default={},
        help='JSON merged into every measured request, e.g. \'{"guided_json": {...}}\' (structured outputs).')
    add("--concurrency", default="1,4,16,32", help="Comma-separated levels: most requests in flight.")
    add("--request-rate", type=float, default=float("inf"),
        help="Poisson arrivals per second (inf = all at once, bounded by --concurrency).")
    add("--warmup", type=int, default=2, help="Unmeasured requests before the first level.")
    add("--max-duration", type=float, default=600.0, help="Seconds per level before no new request starts.")
    add("--request-timeout", type=float, default=600.0, help="Seconds before one request is abandoned.")
    add("--seed", type=int, default=0)
    add("--json", dest="json_path", default=None, help="Write the results as JSON here.")
    add("--plot", default=None, help="Write a PNG of throughput and TTFT p99 against concurrency (needs matplotlib).")
    add("--label", default=None, help="Name of the run in the table, JSON and plot.")
    add("--no-progress", action="store_true", help="No progress bar.")


async def _pick_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_level(client: httpx.AsyncClient, url: str, bodies: list[dict], headers: dict[str, str],
                    concurrency: int, request_rate: float, max_duration: float, seed: int,
                    progress: bool) -> tuple[list[RequestResult], float]:
    """Start requests at Poisson times (or at once), at most `concurrency` in flight; none
    starts after `max_duration` seconds (those already running finish)."""
    slots = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = tqdm(total=len(bodies), desc=f"concurrency {concurrency}", disable=not progress, leave=False)
    start = time.perf_counter()

    def expired() -> bool:
        return time.perf_counter() - start > max_duration

    async def one(body: dict) -> RequestResult | None:
        async with slots:
            if expired():
                return None
            result = await send_request(client, url, body, headers)
        bar.update()
        return result

    tasks = []
    for body in bodies:
        if expired():
            break
        tasks.append(asyncio.create_task(one(body)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = [result for result in await asyncio.gather(*tasks) if result is not None]
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def level_seed(seed: int, dataset: str, concurrency: int) -> str:
    """The dataset seed of one level: all three parts, so no level of another run replays these
    prompts (seed + concurrency made --seed 116 at c=16 replay --seed 100 at c=32, and with one
    seed a random prompt was the start of a shared-prefix group's prefix)."""
    return f"{seed}/{dataset}/{concurrency}"


async def _bench(args: argparse.Namespace) -> list[LevelReport]:
    low, high = (int(part) for part in args.token_range.split(","))
    def dataset(seed: str) -> list[BenchRequest]:
        return build_dataset(DatasetConfig(
            name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, prompt_format=args.prompt_format, token_low=low, token_high=high,
            num_groups=args.num_groups, prefix_len=args.prefix_len, seed=seed, corpus=args.corpus))

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base_url = args.base_url.rstrip("/")
    endpoint = args.endpoint or ("/v1/chat/completions" if args.dataset in ("chat", "grounded") else "/v1/completions")
    levels = [int(level) for level in args.concurrency.split(",")]
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0), limits=limits) as client:
        model = args.model or await _pick_model(client, base_url, headers)
        warmup = [BenchRequest("Hello", None, 1, 8).body(model, False) for _ in range(args.warmup)]
        await run_level(client, base_url + endpoint, warmup, headers, 1, float("inf"), args.max_duration,
                        args.seed, False)
        reports = []
        for level in levels:
            models = args.lora_modules or [model]
            bodies = [{**request.body(models[i % len(models)], args.ignore_eos), **args.extra_body}
                      for i, request in enumerate(dataset(level_seed(args.seed, args.dataset, level)))]
            results, duration = await run_level(client, base_url + endpoint, bodies, headers, level,
                                                 args.request_rate, args.max_duration, args.seed,
                                                 not args.no_progress)
            reports.append(summarize(results, duration, level, args.request_rate))
    return reports


def run(args: argparse.Namespace) -> int:
    reports = asyncio.run(_bench(args))
    label = args.label or f"{args.dataset} {args.base_url}"
    print(f"{label}: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}")
    print(format_table(reports))
    if args.json_path:
        config = {key: value for key, value in vars(args).items() if key not in ("api_key", "run")}
        with open(args.json_path, "w") as handle:
            json.dump({"label": label, "config": config, "levels": [asdict(r) for r in reports]}, handle, indent=2)
    if args.plot:
        plot(reports, args.plot, label)
    return 0 if all(report.completed for report in reports) else 1
