"""`--quantize-lm-head q8_0`: the output projection computes with GGUF Q8_0's values (gguf-py's
own quantize and dequantize are the reference) at every batch size, on the kernel's tiles for
decode-sized batches and the dequantized matrix beyond; the embedding lookup keeps the
checkpoint's values; where it cannot run, it says why."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from kubeinfer.kernels import ops_cpu
from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.model.layers.linear import can_pack, linear, pack_weight
from kubeinfer.server.model.loader import load_model
from kubeinfer.server.model.quantization.lm_head import quantize_lm_head
from tests.helpers.tiny_models import build_tiny_llama

pytestmark = pytest.mark.integration
needs_kernel = pytest.mark.skipif(not ops_cpu.gguf_kernel_available(), reason="needs the GGUF kernel (AVX512-BF16)")


def q8_0_values(weight: torch.Tensor) -> torch.Tensor:
    """The matrix as Q8_0 stores it, per gguf-py, in bf16 (exact: int8 times an fp16 scale)."""
    blocks = quants.quantize(weight.float().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_logits_are_the_q8_0_matrix_at_every_batch_size(tmp_path, tied):
    path, _ = build_tiny_llama(tmp_path, tie_word_embeddings=tied)
    plain = load_model(str(path), "bfloat16", "cpu").model
    quantized = load_model(str(path), "bfloat16", "cpu", quantize_head="q8_0").model
    matrix = q8_0_values(plain.input_embeddings().weight if tied else plain.lm_head.weight)
    assert not torch.equal(matrix, plain.input_embeddings().weight if tied else plain.lm_head.weight)
    hidden = torch.randn(300, matrix.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = F.linear(hidden.float(), matrix.float())
    for rows in (1, 4, 300):   # the tiles up to the kernel's row limit, the dense matrix beyond
        torch.testing.assert_close(quantized.logits(hidden[:rows]), want[:rows], rtol=1e-2, atol=2e-2)
    # beyond the tiles' rows: exactly the model's own GEMM over the Q8_0 matrix, not the checkpoint's
    original = plain.input_embeddings().weight if tied else plain.lm_head.weight
    same_gemm = {name: linear(hidden, w, pack_weight(w) if can_pack(w) else None).float()
                 for name, w in (("q8_0", matrix), ("checkpoint", original))}
    assert torch.equal(quantized.logits(hidden), same_gemm["q8_0"])
    assert not torch.equal(quantized.logits(hidden), same_gemm["checkpoint"])
    decode_sized, prefill_sized = quantized.logits(hidden[:4]), quantized.logits(hidden)[:4]
    torch.testing.assert_close(decode_sized, prefill_sized, rtol=1e-2, atol=2e-2)
    ids = torch.arange(matrix.shape[0])
    assert torch.equal(quantized.input_embeddings()(ids), plain.input_embeddings()(ids))


@needs_kernel
def test_serving_with_it_gives_the_tokens_of_a_checkpoint_holding_the_q8_0_values(tmp_path):
    """End to end: the engine with --quantize-lm-head q8_0 generates what the plain engine does on
    the same checkpoint with its lm_head replaced by the Q8_0 values (rounded to bf16 as loaded)."""
    from safetensors.torch import load_file, save_file

    from kubeinfer.server.engine.llm import LLM
    from kubeinfer.server.engine.sampling_params import SamplingParams

    path, _ = build_tiny_llama(tmp_path)
    replaced = tmp_path / "q8-0-values"
    shutil.copytree(path, replaced)
    tensors = load_file(replaced / "model.safetensors")
    tensors["lm_head.weight"] = q8_0_values(tensors["lm_head.weight"].to(torch.bfloat16)).float()
    save_file(tensors, replaced / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 7], [200, 3, 3, 150], list(range(30, 70))]
    runs, heads = {}, {}
    for name, source, mode in (("flag", path, "q8_0"), ("values", replaced, "none"), ("auto", replaced, "auto"),
                               ("auto-bf16", path, "auto")):
        llm = LLM(model=str(source), dtype="bfloat16", device="cpu", quantize_lm_head=mode, kv_cache_memory=1 << 24)
        runs[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        heads[name] = llm.engine.loaded.model.lm_head.weight_quant is not None
    assert runs["flag"] == runs["values"] == runs["auto"]
    # auto takes the Q8_0 form where the values are Q8_0's already, and only there
    assert heads == {"flag": True, "values": False, "auto": True, "auto-bf16": False}


@needs_kernel
def test_auto_takes_a_tied_matrix_of_q8_0_values_and_keeps_its_logits(tmp_path):
    path, _ = build_tiny_llama(tmp_path, tie_word_embeddings=True)
    plain = load_model(str(path), "bfloat16", "cpu").model
    embedding = plain.input_embeddings().weight
    embedding.data = q8_0_values(embedding)
    hidden = torch.randn(300, embedding.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = plain.logits(hidden)
    assert quantize_lm_head(plain, "auto")
    assert plain.quantized_tied_head.weight is embedding   # no second copy of the same values
    for rows in (4, 300):   # only float32 summation order differs
        torch.testing.assert_close(plain.logits(hidden[:rows]), before[:rows], rtol=1e-2, atol=2e-2)


def test_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="quantize_lm_head must be one of auto, none, q8_0"):
        EngineConfig(quantize_lm_head="q4_0")
    with pytest.raises(ValueError, match="not with tensor or pipeline parallelism"):
        EngineConfig(quantize_lm_head="q8_0", tensor_parallel_size=2)
    path, _ = build_tiny_llama(tmp_path)
    with pytest.raises(ValueError, match=r"--quantize-lm-head q8_0: runs on the CPU in bfloat16; this model is float32 on cpu"):
        load_model(str(path), "float32", "cpu", quantize_head="q8_0")
