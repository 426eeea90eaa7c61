"""The W8A8 int8 CPU kernel (kernels/cpu/int8_linear_cpu.c) against the torch form it replaces
(`Int8Weight.forward` without it: per-token int8 quantization, torch._int_mm, float32 rescale):
the same numbers bit for bit, dynamic and static activations, with and without bias, odd sizes."""

import pytest
import torch

from kubeinfer.kernels.cpu import fused_cpu, int8_linear_cpu
from kubeinfer.server.model.quantization.weights import Int8Weight, _int_mm

pytestmark = pytest.mark.integration


def _case(m, k, n, dtype, seed, per_tensor=False):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(1 if per_tensor else n, generator=generator) / 100 + 1e-4
    x = (torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    return weight, scale, x, bias


@pytest.mark.cpu_isas("native", "avx512")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (32, 576, 960), (13, 100, 45), (70, 1536, 576), (9, 3, 5)])
@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_int8_linear_equals_the_torch_form_bit_for_bit(cpu_isa, m, k, n, dtype, activations):
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    weight, scale, x, bias = _case(m, k, n, dtype, m * k + n, per_tensor=(m == 13))
    input_scale = torch.tensor(0.02) if activations == "static" else None
    layer = Int8Weight(weight, scale, activations, input_scale)
    packed = int8_linear_cpu.pack(weight, scale)
    for b in (None, bias):
        expected = layer.forward_torch(x, b)
        got = int8_linear_cpu.linear(x, packed, b, input_scale)
        assert got.dtype == dtype and torch.equal(got, expected)
        assert torch.equal(_between_int_mm(x, weight, scale, b, input_scale), expected)
    # a zero row (scale clamped to the epsilon) and a strided view of x
    x = torch.cat([torch.zeros(1, k, dtype=dtype), x])[:, :]
    wide = torch.cat([x, x], dim=1)[:, :k]
    assert torch.equal(int8_linear_cpu.linear(wide, packed, bias, input_scale), layer.forward_torch(x, bias))
    assert torch.equal(_between_int_mm(wide, weight, scale, bias, input_scale), layer.forward_torch(x, bias))


def _between_int_mm(x, weight, scale, bias, input_scale):
    """The kernel's one-pass quantize and rescale around torch._int_mm (mid-size inputs)."""
    xq, x_scale = int8_linear_cpu.quantize_rows(x, input_scale)
    out = int8_linear_cpu.rescale(_int_mm(xq, weight.t()), x_scale, scale, x.dtype)
    return out if bias is None else out + bias


@pytest.mark.cpu_isas("avx2")
def test_without_avx512_vnni_the_kernel_is_not_offered(cpu_isa):
    assert not int8_linear_cpu.available()


def test_bad_inputs_are_refused():
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    packed = int8_linear_cpu.pack(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match=r"CPU rows \[M, 8\]"):
        int8_linear_cpu.linear(torch.zeros(2, 7), packed)
    with pytest.raises(ValueError, match="int8 \\[N, K\\] weight"):
        int8_linear_cpu.pack(torch.zeros(4, 8), torch.ones(4))


@pytest.mark.cpu_isas("native")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (16, 576, 960), (17, 128, 45), (70, 1536, 576), (300, 576, 100)])
@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_amx_path_equals_the_torch_form_bit_for_bit(cpu_isa, m, k, n, dtype, activations):
    """AMX-INT8 tiles over the same panels: row counts that are not whole tiles, panels cut short,
    bias or none, a strided x: the numbers of the torch form (and so of the VNNI path)."""
    if not int8_linear_cpu.amx_available():
        pytest.skip("needs AMX-INT8 (and the OS's grant of the tile state)")
    weight, scale, x, bias = _case(m, k, n, dtype, m * k + n, per_tensor=(m == 17))
    input_scale = torch.tensor(0.02) if activations == "static" else None
    layer = Int8Weight(weight, scale, activations, input_scale)
    packed = int8_linear_cpu.pack(weight, scale)
    for b in (None, bias):
        got = int8_linear_cpu.linear(x, packed, b, input_scale, use_amx=True)
        assert got.dtype == dtype and torch.equal(got, layer.forward_torch(x, b))
    wide = torch.cat([x, x], dim=1)[:, :k]
    assert torch.equal(int8_linear_cpu.linear(wide, packed, bias, input_scale, use_amx=True),
                       layer.forward_torch(x, bias))


@pytest.mark.cpu_isas("native")
@pytest.mark.parametrize("m, k, inter", [(1, 64, 48), (17, 576, 1536), (300, 128, 96)])
@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_amx_gate_up_with_silu_equals_linear_then_silu_and_mul(cpu_isa, m, k, inter, activations, per_tensor):
    """SiLU-and-mul in the AMX epilogue: bit for bit the AMX linear's bf16 [M, 2I] put through
    fused_cpu.silu_and_mul, per-channel and per-tensor scales, rows that are not whole tiles."""
    if not int8_linear_cpu.amx_available():
        pytest.skip("needs AMX-INT8 (and the OS's grant of the tile state)")
    weight, scale, x, _ = _case(m, k, 2 * inter, torch.bfloat16, m + k + inter, per_tensor=per_tensor)
    input_scale = torch.tensor(0.02) if activations == "static" else None
    packed = int8_linear_cpu.pack(weight, scale)
    assert int8_linear_cpu.amx_silu_fits(packed)
    expected = fused_cpu.silu_and_mul(int8_linear_cpu.linear(x, packed, None, input_scale, use_amx=True))
    got = int8_linear_cpu.linear_silu_and_mul(x, packed, input_scale)
    assert got.shape == (m, inter) and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="no AMX gate\\|up path"):
        int8_linear_cpu.linear_silu_and_mul(x, int8_linear_cpu.pack(weight[:-2], scale[:-2] if not per_tensor
                                                                    else scale), input_scale)


def test_amx_path_is_refused_where_it_cannot_run():
    """K not a multiple of 64 (a tile row), or no AMX here: an error, never a tile instruction."""
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    packed = int8_linear_cpu.pack(torch.ones(16, 96, dtype=torch.int8), torch.ones(16))
    with pytest.raises(RuntimeError, match="no AMX path here for K=96"):
        int8_linear_cpu.linear(torch.ones(4, 96), packed, use_amx=True)
    assert not int8_linear_cpu.amx_takes(64, 96)


def test_the_amx_row_threshold_is_measured_here():
    """Where AMX runs, the threshold is one of the sampled row counts and `amx_takes` follows it
    (None only when AMX never won); without AMX there is none."""
    threshold = int8_linear_cpu.amx_min_rows()
    if int8_linear_cpu.amx_available():
        assert threshold is None or threshold in int8_linear_cpu._PLAN_ROWS
        for rows in int8_linear_cpu._PLAN_ROWS:
            assert int8_linear_cpu.amx_takes(rows, 576) == (threshold is not None and rows >= threshold)
    else:
        assert threshold is None and not int8_linear_cpu.amx_takes(4096, 576)


@pytest.mark.parametrize(("amx_wins_from", "noisy_loss", "want"), [
    (16, None, 16),   # AMX faster from 16 rows on
    (1, None, 1),     # faster everywhere
    (16, 32, 64),     # one loss at 32 rows: the threshold is the first row count that wins from there on
    (None, None, None),   # never faster: VNNI everywhere
])
def test_the_amx_threshold_is_the_first_row_count_amx_wins_from(monkeypatch, amx_wins_from, noisy_loss, want):
    """The decision over the sampled timings, with the timings given: the smallest row count from
    which every larger sample ran faster on AMX."""
    if not (int8_linear_cpu.available() and int8_linear_cpu.amx_available()):
        pytest.skip("needs AMX-INT8")
    calls = []
    monkeypatch.setattr(int8_linear_cpu, "linear", lambda x, weight, use_amx=False: calls.append((x.shape[0], use_amx)))

    def seconds(run):
        run()
        rows, use_amx = calls[-1]
        amx_faster = amx_wins_from is not None and rows >= amx_wins_from and rows != noisy_loss
        return 1.0 if use_amx == amx_faster else 2.0

    monkeypatch.setattr(int8_linear_cpu, "_best_seconds", seconds)
    int8_linear_cpu.amx_min_rows.cache_clear()
    try:
        assert int8_linear_cpu.amx_min_rows() == want
    finally:
        int8_linear_cpu.amx_min_rows.cache_clear()


def test_int8_weight_takes_amx_from_the_measured_row_count(monkeypatch):
    """With a measured threshold of 8 rows, fewer rows take the VNNI kernel and more the AMX
    path, never torch's GEMM; K not a multiple of 64 keeps the VNNI/torch split."""
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    monkeypatch.setattr(int8_linear_cpu, "amx_min_rows", lambda: 8)
    calls, quantized = [], []
    real, real_quantize = int8_linear_cpu.linear, int8_linear_cpu.quantize_rows

    def linear(x, weight, bias=None, input_scale=None, use_amx=False):   # the VNNI numbers are the AMX ones
        calls.append((x.shape[0], use_amx))
        return real(x, weight, bias, input_scale)

    monkeypatch.setattr(int8_linear_cpu, "linear", linear)
    monkeypatch.setattr(int8_linear_cpu, "quantize_rows",
                        lambda *args: quantized.append(args[0].shape[0]) or real_quantize(*args))
    weight, scale, _, bias = _case(4, 64, 48, torch.bfloat16, 7)
    layer = Int8Weight(weight, scale, "dynamic")
    for rows in (4, 8, 200):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(layer.forward(x, bias), layer.forward_torch(x, bias))
    assert calls == [(4, False), (8, True), (200, True)] and quantized == []
    odd = Int8Weight(torch.ones(48, 96, dtype=torch.int8), torch.ones(48), "dynamic")
    odd.forward(torch.ones(200, 96, dtype=torch.bfloat16), None)
    assert quantized == [200]
    fused = []
    monkeypatch.setattr(int8_linear_cpu, "linear_silu_and_mul",
                        lambda x, weight, input_scale=None: fused.append(x.shape[0]) or fused_cpu.silu_and_mul(
                            real(x, weight, None, input_scale)))
    gate_up = Int8Weight(*_case(1, 64, 96, torch.bfloat16, 3)[:2], "dynamic")
    for rows in (4, 8, 200):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        got = gate_up.forward_silu_and_mul(x)
        assert (got is None) == (rows < 8)
        if got is not None:
            assert torch.equal(got, fused_cpu.silu_and_mul(gate_up.forward_torch(x, None)))
    assert fused == [8, 200]


def test_int8_weight_takes_the_kernel_where_it_is_faster(monkeypatch):
    """Without AMX: decode-sized inputs and large outputs go to the kernel, the rows between to
    torch's GEMM between the kernel's quantize and rescale (BENCHMARKS.md, issue 23); all give
    the torch form's numbers."""
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    monkeypatch.setattr(int8_linear_cpu, "amx_min_rows", lambda: None)
    weight, scale, x, bias = _case(4, 64, 48, torch.bfloat16, 7)
    layer = Int8Weight(weight, scale, "dynamic")
    calls, quantized = [], []
    real, real_quantize = int8_linear_cpu.linear, int8_linear_cpu.quantize_rows
    monkeypatch.setattr(int8_linear_cpu, "linear", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    monkeypatch.setattr(int8_linear_cpu, "quantize_rows",
                        lambda *args: quantized.append(args[0].shape[0]) or real_quantize(*args))
    for rows in (4, 200):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(layer.forward(x, bias), layer.forward_torch(x, bias))
    assert calls == [4] and quantized == [200]
    big = Int8Weight(torch.ones(4096, 8, dtype=torch.int8), torch.ones(4096), "dynamic")
    big.forward(torch.ones(2048, 8, dtype=torch.bfloat16), None)
    assert calls == [4, 2048]


@pytest.mark.cpu_isas("native", "avx512")
@pytest.mark.parametrize("m, k, inter", [(200, 576, 1536), (70, 64, 40), (3, 16, 7)])
@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_rescale_silu_and_mul_equals_rescale_then_silu_and_mul(cpu_isa, m, k, inter, activations, per_tensor):
    """The gate|up products rescaled and put through SiLU-and-mul in one pass: bit for bit the two
    passes (bf16 rescale, then fused_cpu.silu_and_mul), per-channel and per-tensor weight scales,
    inter not a multiple of 16 included."""
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    weight, scale, x, _ = _case(m, k, 2 * inter, torch.bfloat16, m + k + inter, per_tensor=per_tensor)
    xq, x_scale = int8_linear_cpu.quantize_rows(x, torch.tensor(0.02) if activations == "static" else None)
    products = _int_mm(xq, weight.t())
    expected = fused_cpu.silu_and_mul(int8_linear_cpu.rescale(products, x_scale, scale, torch.bfloat16))
    got = int8_linear_cpu.rescale_silu_and_mul(products, x_scale, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (m, inter) and torch.equal(got, expected)


def test_gate_up_layer_fuses_silu_only_where_it_goes_through_int_mm(monkeypatch):
    """Without AMX, a W8A8 gate|up layer at prefill sizes runs the one-pass rescale + SiLU, with the
    numbers of its forward then SiLU-and-mul; at decode sizes (the fused GEMM kernel's) it runs those
    two steps."""
    if not int8_linear_cpu.available():
        pytest.skip("needs AVX512-VNNI and AVX512-BF16")
    monkeypatch.setattr(int8_linear_cpu, "amx_min_rows", lambda: None)
    from kubeinfer.server.model.layers.linear import MergedLinear
    weight, scale, _, _ = _case(1, 64, 96, torch.bfloat16, 11)
    layer = MergedLinear(64, [48, 48], bias=False)
    layer.weight = None
    layer.weight_quant = Int8Weight(weight, scale, "dynamic")
    fused = []
    real = int8_linear_cpu.rescale_silu_and_mul
    monkeypatch.setattr(int8_linear_cpu, "rescale_silu_and_mul", lambda *args: fused.append(1) or real(*args))
    for rows, fuses in ((200, True), (4, False)):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(layer.silu_and_mul(x), fused_cpu.silu_and_mul(layer(x)))
        assert bool(fused) == fuses
        fused.clear()
