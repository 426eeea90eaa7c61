"""Fused RMSNorm (+ residual) against the torch reference and transformers' LlamaRMSNorm."""

import pytest
import torch

from kubeinfer.kernels.reference.rms_norm_ref import rms_norm_ref
from kubeinfer.kernels.triton.rms_norm import rms_norm

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_matches_reference(hidden, dtype):
    x = torch.randn(5, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_residual_returns_the_sum_and_leaves_inputs_alone(dtype):
    x, residual = torch.randn(2, 3, 576).to(dtype), torch.randn(2, 3, 576).to(dtype)
    weight = torch.rand(576).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = rms_norm(x, weight, 1e-5, residual=residual)
    want_out, want_residual = rms_norm_ref(x, weight, 1e-5, residual=residual)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    assert torch.equal(new_residual, want_residual) and new_residual.shape == x.shape
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_reference_matches_transformers_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(64, eps=1e-6)
    hf.weight.data = torch.rand(64)
    x = torch.randn(4, 64)
    torch.testing.assert_close(rms_norm_ref(x, hf.weight.data, 1e-6), hf(x))


def test_float32_weight_on_float16_activations_promotes_like_torch():
    x, weight = torch.randn(3, 64).half(), torch.rand(64)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=1e-3, rtol=1e-3)
