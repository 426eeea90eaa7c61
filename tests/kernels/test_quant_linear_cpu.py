"""The quantized-linear CPU kernel against the `gguf` package's dequantization.

The packed tiles must stand for exactly the bf16 weights the loader makes (float32 dequant,
rounded to nearest even), and the product must equal x @ W.T in float32 up to the final bf16
rounding of the output: sums run in float32 in another order, so an output element may land
on the neighbouring bf16 value (one ulp), never further; near zero, where terms cancel, the
float32 summation error itself (~1e-6 of the sum of |terms|) is allowed on top.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kubeinfer.kernels.cpu import cpu_build, quant_linear_cpu

# The kernel needs AVX512-BF16 (an AVX2 build has none): it runs as built for this CPU and as
# built without AMX (the register path alone, as on an AMD EPYC with AVX-512).
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif("avx512_bf16" in cpu_build.missing_cpu_flags("avx512"),
                                 reason="needs avx512_bf16, which this CPU lacks"),
              pytest.mark.usefixtures("cpu_isa"), pytest.mark.cpu_isas("native", "avx512")]
QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF blocks [rows, cols/32, bytes] with sane fp16 scales (random bytes can be NaN)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, quant_linear_cpu.BLOCK_BYTES[qtype]), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(0.001, 0.05, size=(rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    if qtype == "Q4_1":
        blocks[..., 2:4] = rng.uniform(-0.3, 0.0, size=(rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks)


def _reference_weight(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    rows = blocks.shape[0]
    values = quants.dequantize(blocks.reshape(rows, -1).numpy(), GGMLQuantizationType[qtype])
    return torch.from_numpy(values.reshape(rows, -1)).to(torch.bfloat16)


def _assert_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """got (bf16) is x @ weight.T (+ bias) in float32 rounded to bf16, or a neighbour of that value."""
    want = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    allowed = want.abs() * 2 ** -7 + 1e-6 * (x.float().abs() @ weight.float().abs().T)   # bf16: 8 significant bits
    assert ((got.float() - want).abs() <= allowed).all(), (got.float() - want).abs().max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_tiles_stand_for_the_dequantized_bf16_weights_bit_for_bit(qtype):
    blocks = _blocks(qtype, rows=48, cols=96)
    packed = quant_linear_cpu.pack(qtype, blocks)
    assert packed.tiles.shape[:2] == (3, 3)
    assert torch.equal(quant_linear_cpu.unpack(packed), _reference_weight(qtype, blocks))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_few_rows_match_float32_product(qtype, rows):
    blocks = _blocks(qtype, rows=64, cols=128, seed=rows)
    weight, bias = _reference_weight(qtype, blocks), torch.randn(64).to(torch.bfloat16)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    packed = quant_linear_cpu.pack(qtype, blocks)
    for use_amx in (False, quant_linear_cpu.amx_available()):
        got = quant_linear_cpu.linear(x, packed, bias, use_amx=use_amx)
        _assert_product(got, x, weight, bias)


@pytest.mark.cpu_isas("native")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [5, 16, 17, 64, 97, 200])
def test_amx_rows_match_float32_product(qtype, rows, amx):
    """Row counts around the 16-row tiles and the 96-row passes; x given as a non-contiguous view."""
    blocks = _blocks(qtype, rows=80, cols=160, seed=rows)
    weight = _reference_weight(qtype, blocks)
    x = torch.randn(160, rows, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).T
    got = quant_linear_cpu.linear(x, quant_linear_cpu.pack(qtype, blocks))
    _assert_product(got, x, weight)


def test_many_rows_without_amx_are_refused_not_computed():
    packed = quant_linear_cpu.pack("Q8_0", _blocks("Q8_0", rows=16, cols=32))
    with pytest.raises(RuntimeError, match="status 2"):
        quant_linear_cpu.linear(torch.zeros(5, 32, dtype=torch.bfloat16), packed, use_amx=False)
    assert not quant_linear_cpu.faster_than_dense(quant_linear_cpu.MAX_ROWS_AMX + 1)


def test_bad_shapes_and_inputs_are_clear_errors():
    assert not quant_linear_cpu.can_pack("Q4_1", 24, 64) and not quant_linear_cpu.can_pack("Q4_K", 16, 256)
    with pytest.raises(ValueError, match="cannot pack Q4_1"):
        quant_linear_cpu.pack("Q4_1", _blocks("Q4_1", rows=24, cols=64))
    packed = quant_linear_cpu.pack("Q4_1", _blocks("Q4_1", rows=16, cols=64))
    with pytest.raises(ValueError, match="bf16 x"):
        quant_linear_cpu.linear(torch.zeros(2, 64), packed)
    with pytest.raises(ValueError, match=r"bf16 x \[rows, 64\]"):
        quant_linear_cpu.linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed)


def test_model_linear_uses_the_quants_up_to_the_row_limit_and_the_dense_weight_beyond():
    """`Linear` with both forms, made to disagree on purpose (dense weight all zero): batches up to
    the kernel's row limit come from the quants, larger ones from the dense GEMM."""
    from kubeinfer.server.model.layers.linear import Linear
    from kubeinfer.server.model.quantization.weights import GGUFBlockWeight

    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.zero_()
    layer.pack()
    tiles = quant_linear_cpu.pack("Q4_1", _blocks("Q4_1", rows=32, cols=64))
    layer.weight_quant = GGUFBlockWeight(tiles, layer.weight, layer.packed)
    limit = quant_linear_cpu.MAX_ROWS_AMX if quant_linear_cpu.amx_available() else quant_linear_cpu.MAX_ROWS_AVX512
    for rows in (1, limit):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        out = layer(x)
        assert torch.equal(out, quant_linear_cpu.linear(x, tiles)) and out.abs().sum() > 0
    assert torch.equal(layer(torch.ones(limit + 1, 64, dtype=torch.bfloat16)),
                       torch.zeros(limit + 1, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_gives_the_reference_bf16_weights_bit_for_bit(qtype):
    blocks = _blocks(qtype, rows=40, cols=160, seed=7)
    dense = quant_linear_cpu.dequantize(qtype, blocks.reshape(-1), 40, 160)
    assert dense.dtype == torch.bfloat16 and dense.shape == (40, 160)
    assert torch.equal(dense, _reference_weight(qtype, blocks))
    with pytest.raises(ValueError, match="cannot dequantize"):
        quant_linear_cpu.dequantize(qtype, blocks.reshape(-1), 41, 160)
    with pytest.raises(ValueError, match="cannot dequantize"):
        quant_linear_cpu.dequantize(qtype, blocks.reshape(-1).to(torch.int32), 40, 160)
