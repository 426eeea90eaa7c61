"""GGUF reading and dequantization against the `gguf` package's reference implementations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, quants
from gguf import GGMLQuantizationType as Q

from kubeinfer.server.model.checkpoints.gguf_checkpoint import hf_name, unpermute_rope_rows
from kubeinfer.server.model.checkpoints.gguf_dequant import SUPPORTED_TYPES, dequantize
from kubeinfer.server.model.checkpoints.gguf_reader import QUANT_SIZES, GGUFFile, GGUFTensor, QType
from kubeinfer.server.model.loader import embedded_model_path
from kubeinfer.server.model.tokenizer.gguf_tokenizer import _byte_spelling, tokenizer_from_gguf

pytestmark = pytest.mark.unit

# byte offsets of the fp16 scale fields in each block, filled with sane values (random bytes can be NaN)
_FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q6_K: [208]}


def _random_raw(qtype: Q, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(int(qtype))
    if qtype == Q.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return (rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).view(
            np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in _FP16_FIELDS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
def test_dequantize_matches_gguf_reference(qtype):
    raw = _random_raw(qtype, rows=6, cols=512)
    ours = dequantize(GGUFTensor("w", (6, 512), qtype, raw), torch.float32)
    np.testing.assert_array_equal(ours.numpy(), quants.dequantize(raw, qtype).reshape(6, 512))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_bf16_dequantize_is_the_rounded_reference(qtype, monkeypatch):
    """bf16 loads round the exact values; Q4_0/Q4_1/Q8_0 take the C kernel where it builds."""
    from kubeinfer.kernels.cpu import quant_linear_cpu

    calls = []
    kernel = quant_linear_cpu.dequantize
    monkeypatch.setattr(quant_linear_cpu, "dequantize", lambda *args: calls.append(args[0]) or kernel(*args))
    raw = _random_raw(qtype, rows=6, cols=512)
    ours = dequantize(GGUFTensor("w", (2, 3, 512), qtype, raw), torch.bfloat16)
    reference = torch.from_numpy(quants.dequantize(raw, qtype).reshape(2, 3, 512)).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, reference)
    takes_kernel = qtype.name in quant_linear_cpu.BLOCK_BYTES and quant_linear_cpu.available()
    assert calls == ([qtype.name] if takes_kernel else [])


def test_unsupported_quantization_is_a_clear_error():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        dequantize(GGUFTensor("w", (1, 256), Q.IQ2_XXS, np.zeros((1, 66), dtype=np.uint8)), torch.float32)


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's converter: reshape(heads, 2, d/2, ...) -> swap(1, 2) -> flatten; we must undo it."""
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rope_rows(permuted, heads), weight)
    bias = torch.randn(heads * head_dim)
    assert torch.equal(unpermute_rope_rows(bias.reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1), heads), bias)


def test_tensor_names_map_to_transformers_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="not part of a Llama-family model"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_reader_matches_gguf_reader_on_embedded_file():
    path = embedded_model_path()
    ours, reference = GGUFFile(path), GGUFReader(path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        assert ours.metadata[key] == (pytest.approx(expected) if isinstance(expected, float) else expected), key
    assert list(ours.tensors) == [tensor.name for tensor in reference.tensors]
    for tensor in reference.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.qtype == tensor.tensor_type and mine.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert np.array_equal(mine.data.reshape(-1), tensor.data.reshape(-1).view(np.uint8))


def test_not_a_gguf_file_is_rejected(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF v2/v3 file"):
        GGUFFile(bogus)


def test_own_type_table_matches_gguf():
    """The reader carries its own ids and block sizes so that serving does not import `gguf`."""
    assert set(SUPPORTED_TYPES) == set(QType)
    for qtype in QType:
        assert int(qtype) == int(Q[qtype.name]) and QUANT_SIZES[qtype] == GGML_QUANT_SIZES[Q[qtype.name]]


def test_reader_sizes_other_types_and_dequantize_names_them(tmp_path):
    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(path, "llama")
    block_size, type_size = GGML_QUANT_SIZES[Q.Q5_0]
    writer.add_tensor("a", np.zeros((2, 64 // block_size * type_size), dtype=np.uint8), raw_dtype=Q.Q5_0)
    writer.add_tensor("b", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFFile(path).tensors
    assert tensors["a"].qtype == Q.Q5_0 and tensors["a"].shape == (2, 64)
    assert dequantize(tensors["b"], torch.float32).tolist() == list(range(8))
    with pytest.raises(ValueError, match="Q5_0 is not supported"):
        dequantize(tensors["a"], torch.float32)


def test_tokens_spelled_outside_the_byte_alphabet_are_respelled():
    """A converter that wrote raw UTF-8 ("€") instead of GPT-2's byte spelling: the vocabulary gets
    the byte spelling, so the token is still found."""
    spelling = _byte_spelling()
    tokens = [spelling[b] for b in range(256)] + ["€", "-]^\\"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": []}
    vocab = tokenizer_from_gguf(meta).get_vocab()
    assert vocab["".join(spelling[b] for b in "€".encode())] == 256
    assert vocab["-]^\\"] == 257 and all(vocab[spelling[b]] == b for b in range(256))
