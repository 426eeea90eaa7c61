"""Dequantize a GGUF checkpoint into a Hugging Face directory (bf16 safetensors + tokenizer),
so vLLM, kubeinfer and transformers load the very weights llama.cpp serves from the GGUF.

    python benchmarks/convert_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf out_dir
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def convert(gguf: Path, out: Path) -> None:
    quantization = GgufConfig(gguf_file=gguf.name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 quantization_config=quantization)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.quantization_config = None  # the output is plain dense bf16
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
