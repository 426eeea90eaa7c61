"""Tensor parallelism for quantized checkpoints: TP=2 follows TP=1 on the same checkpoint.

The checkpoints are those of tests/model/test_quantized_checkpoints.py (compressed-tensors
W4A16 / W8A8-int8 / FP8 through the package, GPTQ / AWQ / fp8 from known integer weights) on
the tiny Llama / Qwen2 (hidden 64, intermediate 128, 4 heads): at TP=2 o_proj and down_proj are
cut by input features into whole groups of 16 or 32, q/k/v and gate/up by output features.

Tolerance (greedy, float32, the near-tie rule of parity.py): formats whose activations are not
re-quantized per rank (W4A16, GPTQ, AWQ, static scales) differ from TP=1 only in the order of
the float32 sums: logprobs within 1e-4 as for dense models. Dynamic activation scales (W8A8-int8
per token, fp8 per token) are taken by each rank over its half of a row-parallel layer's input,
as vLLM does, so TP=2 rounds those inputs on another (finer) grid than TP=1: on these random
models, whose next-token distributions are nearly flat, chosen-token logprobs moved by up to
0.02 (int8) and 0.14 (fp8) within 5 steps and a top-2 swap followed after 7, so those formats
are compared over 5 decode steps with logprobs within 0.25.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.quantized_models import quantize_compressed_tensors, write_awq, write_fp8, write_gptq
from helpers.tiny_models import build_tiny_llama, build_tiny_qwen2, make_tiny_llama
from parity import assert_greedy_parity
from test_tp_parity import ENGINE, GREEDY, TINY_TOL, random_prompts

from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.model.checkpoints.checkpoint import Slice
from kubeinfer.server.model.quantization.weights import PackedIntWeight, pack_rows
from kubeinfer.server.parallel.launch import load_tensor_parallel
from kubeinfer.server.parallel.quantized import shard_quantized

pytestmark = pytest.mark.integration

DYNAMIC_TOL = dict(tie_gap=0.25, logprob=0.25)
DYNAMIC_STEPS = 5
_INT = {"type": "int", "symmetric": True}
_TOKEN = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
SCHEMES = {
    "w4a16": {"weights": {"num_bits": 4, **_INT, "strategy": "group", "group_size": 32}},
    "w4a16-asym-g16": {"weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                   "group_size": 16}},
    "w8a8-int8": {"weights": {"num_bits": 8, **_INT, "strategy": "channel"}, "input_activations": {**_TOKEN, **_INT}},
    "w8a8-int8-static": {"weights": {"num_bits": 8, **_INT, "strategy": "tensor"},
                         "input_activations": {**_TOKEN, **_INT, "strategy": "tensor", "dynamic": False}},
    "fp8-dynamic": {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                    "input_activations": {**_TOKEN, "type": "float"}},
}
BUILDERS = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2}


def _compressed(name: str):
    def write(path, hf_model, target):
        static = 0.04 if name == "w8a8-int8-static" else None
        return quantize_compressed_tensors(path, hf_model, SCHEMES[name], target, static)
    return write


CHECKPOINTS = {   # id -> (family, KV heads, writer, tolerance)
    "ct-w4a16-llama": ("llama", 2, _compressed("w4a16"), TINY_TOL),
    "ct-w4a16-asym-g16-qwen2-kv1": ("qwen2", 1, _compressed("w4a16-asym-g16"), TINY_TOL),
    "ct-w8a8-int8-qwen2": ("qwen2", 2, _compressed("w8a8-int8"), DYNAMIC_TOL),
    "ct-w8a8-int8-static-llama": ("llama", 2, _compressed("w8a8-int8-static"), TINY_TOL),
    "ct-fp8-dynamic-llama-kv1": ("llama", 1, _compressed("fp8-dynamic"), DYNAMIC_TOL),
    "fp8-static-qwen2": ("qwen2", 2, lambda p, m, t: write_fp8(p, m, t, activation_scheme="static"), TINY_TOL),
    "gptq-4bit-sym-qwen2": ("qwen2", 2, lambda p, m, t: write_gptq(p, m, t, symmetric=True), TINY_TOL),
    "gptq-8bit-llama": ("llama", 2, lambda p, m, t: write_gptq(p, m, t, bits=8), TINY_TOL),
    "awq-llama": ("llama", 2, write_awq, TINY_TOL),
    "awq-qwen2-kv1": ("qwen2", 1, write_awq, TINY_TOL),
}


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_quantized_checkpoint_tp2_matches_tp1(checkpoint, tmp_path, make_tp_llm):
    family, kv_heads, write, tolerance = CHECKPOINTS[checkpoint]
    path, hf_model = BUILDERS[family](tmp_path, num_kv_heads=kv_heads)
    quantized, _ = write(path, hf_model, tmp_path / "quantized")
    prompts = random_prompts(4, seed=kv_heads)
    params = GREEDY if tolerance is TINY_TOL else dataclasses.replace(GREEDY, max_tokens=DYNAMIC_STEPS)
    reference = LLM(str(quantized), **ENGINE).generate(prompts, params)
    tp = make_tp_llm(str(quantized), tensor_parallel_size=2, **ENGINE)
    shard = tp.engine.runner.model.shard.model.layers[0]
    assert shard.self_attn.o_proj.weight is None and shard.self_attn.o_proj.weight_quant.in_features == 32
    assert_greedy_parity(tp.generate(prompts, params), reference, **tolerance)
    assert tp.engine.stats().kv_cache_usage == 0.0


def test_act_order_row_parallel_split_is_refused_naming_the_layer(tmp_path, make_tp_llm):
    """GPTQ desc_act scatters each group's input features over the whole input: a row-parallel
    rank would hold parts of groups, which the packed form cannot express."""
    path, hf_model = build_tiny_llama(tmp_path)
    quantized, _ = write_gptq(path, hf_model, tmp_path / "gptq", desc_act=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj: tensor parallel size 2 cannot split "
                                         r"this 4-bit layer by input features: act-order \(g_idx\) puts the input "
                                         r"features of group \d+ on more than one rank"):
        load_tensor_parallel(EngineConfig(model=str(quantized), device="cpu", dtype="float32",
                                          tensor_parallel_size=2))
    # the group stopped its workers: a tensor-parallel engine starts again in this process
    path = make_tiny_llama(tmp_path / "dense")
    assert make_tp_llm(str(path), tensor_parallel_size=2, **ENGINE).generate([[5, 6, 7]], GREEDY)


def _packed(in_features: int, out_features: int, group_size: int, bits: int = 4, perm: torch.Tensor | None = None,
            seed: int = 0) -> PackedIntWeight:
    generator = torch.Generator().manual_seed(seed)
    groups = -(-in_features // group_size)
    q = torch.randint(0, 1 << bits, (in_features, out_features), generator=generator)
    return PackedIntWeight(pack_rows(q, bits), torch.rand(groups, out_features, generator=generator) + 0.5,
                           torch.randint(0, 1 << bits, (groups, out_features), generator=generator).float(), bits,
                           group_size, in_features, out_features, perm)


@pytest.mark.parametrize("in_features, group_size, bits, size", [
    (64, 16, 4, 2),     # cut on word and group boundaries: packed words sliced
    (96, 96, 4, 4),     # per-channel: a cut inside packed words (24 inputs, 8 a word) re-packs
    (72, 8, 8, 3),      # 8-bit, 3 ranks
])
def test_row_shards_sum_to_the_whole_layer(in_features, group_size, bits, size):
    whole = _packed(in_features, 40, group_size, bits)
    x = torch.randn(5, in_features)
    local = in_features // size
    parts = [shard_quantized("layer", whole, Slice(1, r * local, (r + 1) * local, local), size) for r in range(size)]
    total = sum(part.forward(x[:, r * local:(r + 1) * local], None) for r, part in enumerate(parts))
    torch.testing.assert_close(total, whole.forward(x, None), atol=1e-4, rtol=1e-5)


def test_act_order_row_shards_holding_whole_groups_sum_to_the_whole_layer():
    """An act-order layer whose groups each fall on one rank (g_idx permuted within halves) is cut."""
    generator = torch.Generator().manual_seed(1)
    perm = torch.cat([torch.randperm(32, generator=generator), 32 + torch.randperm(32, generator=generator)])
    whole = _packed(64, 24, 16, perm=perm)
    x = torch.randn(3, 64)
    parts = [shard_quantized("layer", whole, Slice(1, r * 32, (r + 1) * 32, 32), 2) for r in range(2)]
    assert all(part.perm is not None and part.in_features == 32 for part in parts)
    total = parts[0].forward(x[:, :32], None) + parts[1].forward(x[:, 32:], None)
    torch.testing.assert_close(total, whole.forward(x, None), atol=1e-4, rtol=1e-5)


def test_column_shards_concatenate_to_the_whole_layer_with_vocab_padding():
    whole = _packed(64, 30, 16)
    x = torch.randn(4, 64)
    parts = [shard_quantized("lm_head", whole, Slice(0, start, stop, 16), 2) for start, stop in ((0, 16), (16, 30))]
    out = torch.cat([part.forward(x, None) for part in parts], -1)
    torch.testing.assert_close(out[:, :30], whole.forward(x, None))
    assert torch.equal(out[:, 30:], torch.zeros(4, 2))


def test_a_row_cut_inside_a_group_is_refused_naming_the_layer():
    whole = _packed(96, 40, 32)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj: tensor parallel size 2 cannot split this "
                                         r"4-bit layer by input features: its input features 48\.\.95 on this rank "
                                         r"split group 1 \(each group of 32"):
        shard_quantized("model.layers.3.mlp.down_proj", whole, Slice(1, 48, 96, 48), 2)


def test_quantized_moe_tp2_matches_tp1(tmp_path, make_tp_llm):
    """Qwen3-MoE in W4A16 with groups of 8: every expert's gate/up cut by output units, down by
    its 48 intermediate inputs into 3 whole groups a rank (RowParallelExperts)."""
    from helpers.quantized_models import write_compressed_moe
    from helpers.tiny_models import build_tiny_qwen3_moe

    path, _ = build_tiny_qwen3_moe(tmp_path)
    scheme = {"weights": {"num_bits": 4, **_INT, "strategy": "group", "group_size": 8}}
    quantized, _ = write_compressed_moe(path, tmp_path / "w4a16-g8", scheme, "pack-quantized")
    prompts = random_prompts(4, seed=5)
    reference = LLM(str(quantized), **ENGINE).generate(prompts, GREEDY)
    tp = make_tp_llm(str(quantized), tensor_parallel_size=2, **ENGINE)
    experts = tp.engine.runner.model.shard.model.layers[0].mlp.experts
    assert experts.w13 is None and all(down.in_features == 24 for _, down in experts.quant)
    assert_greedy_parity(tp.generate(prompts, GREEDY), reference, **TINY_TOL)


def test_quantized_moe_split_inside_a_group_is_refused_naming_the_expert(tmp_path):
    from helpers.quantized_models import write_compressed_moe
    from helpers.tiny_models import build_tiny_qwen3_moe

    path, _ = build_tiny_qwen3_moe(tmp_path)
    scheme = {"weights": {"num_bits": 4, **_INT, "strategy": "group", "group_size": 16}}
    quantized, _ = write_compressed_moe(path, tmp_path / "w4a16-g16", scheme, "pack-quantized")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj: tensor parallel size 2 cannot "
                                         r"split this 4-bit layer by input features: its input features 0\.\.23 on "
                                         r"this rank split group 1"):
        load_tensor_parallel(EngineConfig(model=str(quantized), device="cpu", dtype="float32",
                                          tensor_parallel_size=2))


AT_LOAD_TOL = {"int8": 0.05, "fp8": 0.2}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantization_at_load_tp2_matches_tp1(kind, tmp_path, make_tp_llm):
    """--quantization int8|fp8 on an unquantized checkpoint: each rank quantizes the whole matrix
    per output channel (the scales TP=1 takes), then keeps its part; activations dynamic per token,
    per rank. Compared on the first token after each (chunked) prompt: the top-5 logprobs the two
    share within AT_LOAD_TOL (measured max 0.019 for int8, 0.103 for fp8: the per-rank rounding
    moves them about as far as quantizing does, TP=1 being 0.029 / 0.117 from the unquantized
    model's), and each side's choice among the other's top 5. Free-running, this flat random model's near-ties then part the fp8 sequences.
    """
    path, _ = build_tiny_qwen2(tmp_path)
    engine = dict(ENGINE, quantization=kind)
    params = dataclasses.replace(GREEDY, max_tokens=1, logprobs=5)
    prompts = random_prompts(8, seed=6)
    reference = LLM(str(path), **engine).generate(prompts, params)
    tp = make_tp_llm(str(path), tensor_parallel_size=2, **engine)
    assert tp.engine.runner.model.shard.model.layers[1].mlp.down_proj.weight_quant.in_features == 64
    for ours, theirs in zip(tp.generate(prompts, params), reference, strict=True):
        mine, ref = ours.outputs[0], theirs.outputs[0]
        our_top, ref_top = mine.logprobs[0], ref.logprobs[0]
        assert mine.token_ids[0] in ref_top and ref.token_ids[0] in our_top
        for token in our_top.keys() & ref_top.keys():
            assert abs(our_top[token].logprob - ref_top[token].logprob) < AT_LOAD_TOL[kind]


def test_quantization_at_load_of_a_gguf_file_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="--quantization int8 re-quantizes a GGUF file's weights at load, which is "
                                         "not supported with tensor parallelism yet"):
        load_tensor_parallel(EngineConfig(model="embedded", device="cpu", tensor_parallel_size=3, quantization="int8"))
