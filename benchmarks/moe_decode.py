"""Decode step time of a tiny MoE model against a dense model with the same active parameters.

Both are random-weight checkpoints written by transformers and loaded by the engine's loader:
a Mixtral (8 experts of `--expert-units`, top-2) and a Llama whose MLP has top_k x expert
units, so every token multiplies the same number of weights. Each round times one decode step
of each model (alternating, the order flipped every round) for a batch of sequences that each
hold `--context` cached tokens; the figure is the median over rounds, and their ratio.

    python benchmarks/moe_decode.py --batch 1 8 32 --rounds 30 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.paged import PagedRunner  # noqa: E402
from helpers.tiny_models import tiny_tokenizer_json  # noqa: E402

from kubeinfer.server.model.loader import load_model  # noqa: E402


def _write(kind: str, args: argparse.Namespace, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    dims = dict(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                num_key_value_heads=4, max_position_embeddings=4096)
    if kind == "moe":
        config = MixtralConfig(num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                               intermediate_size=args.expert_units, **dims)
    else:
        config = LlamaConfig(intermediate_size=args.top_k * args.expert_units, **dims)
    path = directory / kind
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())   # the loader wants one; ids are random here
    return path


def _decode_step(runner: PagedRunner, batch: int) -> float:
    seqs = [f"s{i}" for i in range(batch)]
    start = time.perf_counter()
    runner.step([(seq, [7]) for seq in seqs])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-units", type=int, default=1408)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = {kind: load_model(str(_write(kind, args, Path(tmp))), dtype=args.dtype, device="cpu")
                  for kind in ("moe", "dense")}
    print(f"dtype {models['moe'].dtype}, threads {torch.get_num_threads()}, hidden {args.hidden}, "
          f"{args.layers} layers, {args.experts} experts x {args.expert_units} units top-{args.top_k} "
          f"vs dense {args.top_k * args.expert_units} units, context {args.context}")
    for batch in args.batch:
        blocks = batch * (-(-(args.context + args.rounds + 2) // 16)) + 8
        runners = {kind: PagedRunner(loaded.model, num_blocks=blocks, block_size=16)
                   for kind, loaded in models.items()}
        generator = torch.Generator().manual_seed(0)
        for runner in runners.values():   # the cached context, then one warm-up step
            runner.step([(f"s{i}", torch.randint(0, 32000, (args.context,), generator=generator).tolist())
                         for i in range(batch)])
            _decode_step(runner, batch)
        times: dict[str, list[float]] = {"moe": [], "dense": []}
        for round_ in range(args.rounds):
            for kind in (("moe", "dense") if round_ % 2 == 0 else ("dense", "moe")):
                times[kind].append(_decode_step(runners[kind], batch))
        moe, dense = (statistics.median(times[k]) * 1e3 for k in ("moe", "dense"))
        print(f"batch {batch:3d}: MoE {moe:7.2f} ms  dense {dense:7.2f} ms  MoE/dense {moe / dense:.2f}x")


if __name__ == "__main__":
    main()
