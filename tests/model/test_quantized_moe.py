"""Quantized MoE checkpoints (compressed-tensors W4A16 / W8A8-int8, experts included) against
the dequantized model computed by transformers in float32.

The checkpoints quantize every matrix of the tiny Qwen3-MoE / Mixtral's decoder layers (each
expert's gate / up / down, attention, Qwen3-MoE's dense layer) with the compressed-tensors
package, the routers left dense (`helpers.quantized_models.write_compressed_moe`). The reference
is transformers on the dequantized weights, with W8A8's per-token int8 rounding of every
quantized matmul's input (experts too).

Tolerance: max |logit diff| <= 1e-4 in float32, as for the dense families' quantized
checkpoints (tests/model/test_quantized_checkpoints.py); quantization itself moves these logits
by far more (asserted), so a wrong expert, scale or rounding cannot hide under it.
"""

from __future__ import annotations

import pytest
import torch
from helpers.paged import PagedRunner
from helpers.quantized_models import add_activation_fake_quant, add_expert_activation_fake_quant, write_compressed_moe
from helpers.tiny_models import build_tiny_mixtral, build_tiny_qwen3_moe
from test_quantized_checkpoints import FP32_ATOL, PROMPT

from kubeinfer.server.model.loader import load_model
from kubeinfer.server.model.quantization.weights import Int8Weight, PackedIntWeight

pytestmark = pytest.mark.integration

_INT = {"type": "int", "symmetric": True}
SCHEMES = {   # name -> (config group, compressed-tensors format, compute form)
    "w4a16": ({"weights": {"num_bits": 4, **_INT, "strategy": "group", "group_size": 16}}, "pack-quantized",
              PackedIntWeight),
    "w8a8-int8": ({"weights": {"num_bits": 8, **_INT, "strategy": "channel"},
                   "input_activations": {"num_bits": 8, **_INT, "strategy": "token", "dynamic": True}},
                  "int-quantized", Int8Weight),
}
BUILDERS = {"qwen3-moe": build_tiny_qwen3_moe, "mixtral": build_tiny_mixtral}


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("family", list(BUILDERS))
@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_quantized_experts_logits_equal_dequantized_reference(family, scheme_name, tmp_path):
    from transformers import AutoModelForCausalLM

    path, hf_model = BUILDERS[family](tmp_path)
    scheme, format, form = SCHEMES[scheme_name]
    quantized, dequantized = write_compressed_moe(path, tmp_path / scheme_name, scheme, format)
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    if "input_activations" in scheme:
        add_activation_fake_quant(reference, "int8")   # attention (and dense MLP) linears; routers stay exact
        for name, module in reference.named_modules():
            if name.endswith(".gate") and isinstance(module, torch.nn.Linear):
                module._forward_pre_hooks.clear()
        add_expert_activation_fake_quant(reference)
    expected = _logits(reference, PROMPT)
    assert (expected - _logits(hf_model, PROMPT)).abs().max() > 10 * FP32_ATOL   # the quantization is visible

    model = load_model(str(quantized), dtype="float32", device="cpu").model
    experts = next(module for name, module in model.named_modules() if name == "model.layers.0.mlp.experts"
                   or name == "model.layers.0.block_sparse_moe.experts")
    assert experts.w13 is None and experts.w2 is None   # kept quantized in memory
    assert all(isinstance(gate_up, form) and isinstance(down, form) for gate_up, down in experts.quant)
    runner = PagedRunner(model)
    torch.testing.assert_close(runner.step([("a", PROMPT)], all_logits=True), expected, atol=FP32_ATOL, rtol=0)
    decoded = [int(expected[-1].argmax())]
    torch.testing.assert_close(runner.step([("a", decoded)]), _logits(reference, PROMPT + decoded)[-1:],
                               atol=FP32_ATOL, rtol=0)


def test_experts_quantized_only_in_part_are_refused_naming_them(tmp_path):
    """A format that leaves some experts of a layer dense cannot be computed as one stack."""
    import json

    path, _ = build_tiny_qwen3_moe(tmp_path)
    scheme, format, _ = SCHEMES["w8a8-int8"]
    quantized, _ = write_compressed_moe(path, tmp_path / "q", scheme, format)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.2.mlp.experts.3.down_proj")
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.0\.gate_proj, .* are computed as one "
                                         "matrix, so they must be quantized alike"):
        load_model(str(quantized), dtype="float32", device="cpu")
