"""Write random PEFT LoRA adapters for a model kubeinfer serves, for the multi-LoRA benchmark.

    python benchmarks/lora_adapters.py OUT_DIR [--model embedded] [--count 4] [--rank 16]

Each adapter targets all seven projections of every layer (the costliest case), lora_alpha =
2 x rank, and small random A and B (so outputs change but stay sane). Shapes come from the
model's config as kubeinfer reads it; no transformers or peft needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kubeinfer.server.model.loader import read_checkpoint

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(out: Path, config, rank: int, seed: int, model_name: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, (fan_in, fan_out) in shapes(config).items():
            group = "self_attn" if target in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_name, "r": rank,
        "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none"}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    config = read_checkpoint(args.model).config
    for index in range(args.count):
        write_adapter(args.out / f"lora{index}", config, args.rank, index, args.model)
        print(f"lora{index}={args.out / f'lora{index}'}")


if __name__ == "__main__":
    main()
