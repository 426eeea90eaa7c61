"""The embedded SmolLM2 GGUF loaded by us vs transformers loading the same file (it dequantizes
and un-permutes q/k itself), in one prefill, in chunks over the paged cache, and in decode steps.

Tolerance (float32, 30 layers, logits std ~8): one-shot prefill is bit-identical in practice;
chunked prefill and decode change the reduction order inside attention (cached prefix + chunk),
measured max |diff| 7.7e-5, so we allow 2e-3 — still 4000x below the logit spread.
"""

from __future__ import annotations

import pytest
import torch
from helpers.paged import PagedRunner

from kubeinfer.kernels.cpu import quant_linear_cpu
from kubeinfer.server.model.layers.linear import Linear
from kubeinfer.server.model.loader import embedded_model_path, load_model

pytestmark = pytest.mark.integration

FP32_ATOL = 2e-3
# bf16 quantized vs dequantized weights: outputs of each linear are rounded to bf16 after float32
# sums in another order, and a flipped last bit propagates; measured max |diff| 0.59 over 7 rows
BF16_SUM_ORDER_ATOL = 1.0
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def ours():
    return load_model("embedded", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference_model():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_config_from_gguf_metadata(ours):
    config = ours.config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == \
        ("llama", 30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192 and config.eos_token_ids == {2} and config.bos_token_id == 1
    assert ours.name == "SmolLM2-135M-Instruct" and ours.dtype == torch.float32


def test_logits_match_transformers_prefill_chunks_and_decode(ours, reference_model):
    prompt = ours.tokenizer.encode(ours.tokenizer.apply_chat_template(MESSAGES))
    with torch.no_grad():
        reference = reference_model(torch.tensor([prompt])).logits[0]
    greedy = [int(reference[-1].argmax())]
    for _ in range(3):   # extend greedily with the reference model, then compare every step
        with torch.no_grad():
            greedy.append(int(reference_model(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
    with torch.no_grad():
        reference = reference_model(torch.tensor([prompt + greedy[:-1]])).logits[0]

    one_shot = PagedRunner(ours.model, block_size=16, num_blocks=16).step([("a", prompt)], all_logits=True)
    torch.testing.assert_close(one_shot, reference[:len(prompt)], atol=FP32_ATOL, rtol=0)

    runner = PagedRunner(ours.model, block_size=16, num_blocks=16)
    cut1, cut2 = len(prompt) // 3, 2 * len(prompt) // 3 + 1
    steps = [runner.step([("a", prompt[:cut1])], all_logits=True),
             runner.step([("a", prompt[cut1:cut2])], all_logits=True),
             runner.step([("a", prompt[cut2:])], all_logits=True)]
    steps += [runner.step([("a", [token])]) for token in greedy[:-1]]
    logits = torch.cat(steps)
    torch.testing.assert_close(logits, reference, atol=FP32_ATOL, rtol=0)
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == greedy


def test_bfloat16_tracks_float32(ours):
    """bf16 weights and activations: the greedy next token is kept and logits stay close. Measured on
    this prompt's last row: max |diff| 0.54 on logits of std ~8 (transformers' own bf16 run is 1.17 off
    its float32 run over all rows); we allow 1.5."""
    prompt = ours.tokenizer.encode(ours.tokenizer.apply_chat_template(MESSAGES))
    bf16 = load_model("embedded", dtype="bfloat16", device="cpu")
    full = PagedRunner(ours.model, block_size=16, num_blocks=16).step([("a", prompt)])
    half = PagedRunner(bf16.model, block_size=16, num_blocks=16).step([("a", prompt)])
    assert half.dtype == torch.float32 and bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (half - full).abs().max().item() <= 1.5
    assert half.argmax(-1).tolist() == full.argmax(-1).tolist()


@pytest.mark.skipif(not quant_linear_cpu.available(), reason="needs a CPU with AVX512-BF16")
def test_bfloat16_decode_runs_on_the_gguf_quants_with_the_same_weights():
    """quantization=auto keeps each Q4_1/Q8_0 matrix as its GGUF quants (q/k un-permuted, q/k/v and
    gate/up stacked in shard order) standing for exactly the bf16 weights; prefill and decode give
    the greedy tokens of the dequantized model, logits apart only by float32 summation order."""
    quantized = load_model("embedded", dtype="bfloat16", device="cpu")
    dense = load_model("embedded", dtype="bfloat16", device="cpu", quantization="none")
    linears = [module for module in quantized.model.modules() if isinstance(module, Linear)]
    assert len(linears) == 4 * 30 and quantized.model.quantized_tied_head is not None
    for module in linears:
        assert torch.equal(quant_linear_cpu.unpack(module.weight_quant.tiles), module.weight)
    assert torch.equal(quant_linear_cpu.unpack(quantized.model.quantized_tied_head.tiles),
                       quantized.model.model.embed_tokens.weight)
    assert dense.model.quantized_tied_head is None
    assert all(module.weight_quant is None for module in dense.model.modules() if isinstance(module, Linear))

    prompt = quantized.tokenizer.encode(quantized.tokenizer.apply_chat_template(MESSAGES))
    runs = []
    for loaded in (quantized, dense):
        runner = PagedRunner(loaded.model, block_size=16, num_blocks=16)
        logits = [runner.step([("a", prompt)])]
        for _ in range(6):
            logits.append(runner.step([("a", [int(logits[-1].argmax())])]))
        runs.append(torch.cat(logits))
    assert runs[0].argmax(-1).tolist() == runs[1].argmax(-1).tolist()
    assert (runs[0] - runs[1]).abs().max().item() <= BF16_SUM_ORDER_ATOL
