"""Write a random-weight Llama checkpoint of Llama-3.2-1B's shape (vocab 49,152, tied embeddings)
for GPU throughput runs where no model can be downloaded; built on the GPU when there is one.
`--tiny`: the same vocabulary with 2 layers of width 64, for dry runs of those scripts on a CPU.

    python benchmarks/random_llama.py /tmp/llama-1b-random [--tiny]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.tiny_models import tiny_tokenizer_json  # noqa: E402


def main(path: str, tiny: bool = False) -> None:
    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2) if tiny else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8))
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    Path(path, "tokenizer.json").write_text(tiny_tokenizer_json())   # the loader wants one; prompts are ids
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main(sys.argv[1], tiny="--tiny" in sys.argv[2:])
