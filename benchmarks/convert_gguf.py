"""Dequantize a GGUF checkpoint into a Hugging Face directory (bf16 safetensors + tokenizer),
so vLLM, kubeinfer and transformers load the very weights llama.cpp serves from the GGUF.

    python benchmarks/convert_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf out_dir
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def convert(gguf: Path, out: Path) -> None:
    quantization = GgufConfig(gguf_file=gguf.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=quantization)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The output is plain dense bf16: no quantization entry for loaders (vLLM) to act on.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
