"""KUBEINFER_CPU_ISA: the kernels build for less than this CPU has, so the choices CPUs without
AMX or AVX-512 make are tested here too (the kernels' results are in their own test files)."""

import pytest
import torch

from kubeinfer.kernels.cpu import cpu_build, fused_cpu, paged_decode_cpu, paged_prefill_cpu, quant_linear_cpu

pytestmark = pytest.mark.unit


@pytest.mark.cpu_isas("avx512", "avx2")
def test_without_amx_nothing_uses_tiles_and_prefill_needs_avx512_bf16(cpu_isa):
    assert not quant_linear_cpu.amx_available()
    assert paged_prefill_cpu.available(torch.bfloat16, 64) == (cpu_isa == "avx512")   # else torch's SDPA
    assert quant_linear_cpu.available() == (cpu_isa == "avx512")   # the kernel needs AVX512-BF16
    assert not quant_linear_cpu.faster_than_dense(quant_linear_cpu.MAX_ROWS_AVX512 + 1)
    assert fused_cpu.available(torch.zeros(1, dtype=torch.bfloat16)) and paged_decode_cpu.available(torch.bfloat16)


@pytest.mark.cpu_isas("native", "avx512", "avx2")
def test_each_variant_is_its_own_cached_build(cpu_isa):
    path = cpu_build.compiled("fused_cpu")
    assert path is not None and path.exists()
    assert (f"fused_cpu.{cpu_isa}-" in path.name) == (cpu_isa != "native")
    assert cpu_build.compiled("fused_cpu") == path


def test_variants_switch_back_and_an_unknown_one_is_refused(monkeypatch):
    native = cpu_build.compiled("fused_cpu")
    with cpu_build.forced_isa("avx2"):
        assert cpu_build.compiled("fused_cpu") != native
    assert cpu_build.compiled("fused_cpu") == native
    monkeypatch.setenv("KUBEINFER_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="KUBEINFER_CPU_ISA='sse2': expected one of native, avx512, avx2"):
        cpu_build.isa()
