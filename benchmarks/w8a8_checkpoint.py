"""Write the embedded model as a W8A8-int8 compressed-tensors checkpoint, for the issue-23 benchmark.

    python benchmarks/w8a8_checkpoint.py <bf16 HF dir (peers.sh's smollm2-hf)> <target dir>

What llm-compressor's W8A8 int8 preset writes, minus calibration (per-token dynamic activations need
none): symmetric int8 weights with a scale per output channel from each row's min/max (the
`compressed-tensors` package's own `calculate_qparams`), activations int8 per token at run time,
`lm_head` left in bf16; compressed and saved by the package's `ModelCompressor`. The same scheme as
tests/helpers/quantized_models.py applies to the tiny test models, whose logits the tests check.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

SCHEME = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
          "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                "dynamic": True}}


def main(source: Path, target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.bfloat16)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **SCHEME)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            weight = module.weight.detach().float()
            args = module.quantization_scheme.weights
            scale, _ = calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    for side in source.iterdir():  # tokenizer, chat template, generation config
        if side.is_file() and not side.name.endswith(".safetensors") and side.name != "config.json":
            shutil.copy(side, target / side.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
