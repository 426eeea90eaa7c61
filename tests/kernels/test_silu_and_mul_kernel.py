"""SiLU-and-mul against the torch reference, under the interpreter."""

import pytest
import torch

from kubeinfer.kernels.reference.activation_ref import silu_and_mul_ref
from kubeinfer.kernels.triton.activation import silu_and_mul

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(4, 2 * 1536), (2, 3, 2 * 100), (1, 2 * 2500)])
def test_matches_reference(shape, dtype):
    x = (3 * torch.randn(shape)).to(dtype)
    got = silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got, silu_and_mul_ref(x), atol=tol, rtol=tol)


def test_odd_width_is_rejected():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7))
