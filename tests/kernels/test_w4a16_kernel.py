"""The packed-integer GEMM (Triton, under the interpreter) against the torch reference, and the
reference against a dense matmul of weights dequantized by hand.

Tolerances: float32 1e-4 relative to the output's scale (both sum float32 products in another
order); float16 3e-3 (x and the dequantized weight in fp16 for `tl.dot`, sums in float32; the
reference rounds only the output). bf16 is not run: the interpreter does not emulate it.
"""

import pytest
import torch

from kubeinfer.kernels.reference.w4a16_ref import pack_rows, packed_matmul_ref, unpack_rows
from kubeinfer.kernels.triton.w4a16 import matmul

pytestmark = pytest.mark.integration

TOLERANCES = {torch.float32: 1e-4, torch.float16: 3e-3}


def _problem(m: int, n: int, k: int, group_size: int, bits: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (k, n), generator=generator)
    groups = -(-k // group_size)
    scales = torch.rand(groups, n, generator=generator) * 0.02 + 0.005
    zeros = torch.randint(0, top + 1, (groups, n), generator=generator).float()
    x = torch.randn(m, k, generator=generator).to(dtype)
    dense = (q.float() - zeros.repeat_interleave(group_size, 0)[:k]) * scales.repeat_interleave(group_size, 0)[:k]
    return x, pack_rows(q, bits), scales, zeros, dense, q


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips(bits):
    q = torch.randint(0, 1 << bits, (37, 5))
    packed = pack_rows(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (-(-37 // (32 // bits)), 5)
    assert torch.equal(unpack_rows(packed, bits, 37), q.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, group_size, bits", [
    pytest.param(1, 64, 64, 32, 4, id="decode-row"),
    pytest.param(5, 96, 128, 128, 4, id="one-group-per-block"),
    pytest.param(17, 100, 96, 64, 4, id="odd-n-groups-not-dividing-k"),
    pytest.param(33, 48, 72, 16, 4, id="k-not-a-block-multiple"),
    pytest.param(3, 40, 100, 100, 4, id="channel-scales-k-not-word-multiple"),
    pytest.param(20, 64, 96, 32, 8, id="8-bit"),
    pytest.param(2, 72, 56, 56, 8, id="8-bit-channel"),
])
def test_triton_matches_reference(m, n, k, group_size, bits, dtype):
    x, qweight, scales, zeros, dense, _ = _problem(m, n, k, group_size, bits, dtype)
    expected = packed_matmul_ref(x, qweight, scales, zeros, group_size, bits)
    torch.testing.assert_close(expected.float(), (x.float() @ dense).to(dtype).float(), atol=0, rtol=0)
    got = matmul(x, qweight, scales, zeros, group_size, bits)
    assert got.shape == (m, n) and got.dtype == dtype
    scale = expected.float().abs().max().item()
    tol = TOLERANCES[dtype] * max(scale, 1.0)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=0)


def test_bad_shapes_are_refused():
    x, qweight, scales, zeros, _, _ = _problem(2, 64, 64, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="does not hold 128 4-bit rows"):
        matmul(torch.zeros(2, 128), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="expected \\(4, 64\\)"):
        matmul(x, qweight, scales, zeros, 16)
    with pytest.raises(ValueError, match="3-bit"):
        matmul(x, qweight, scales, zeros, 32, bits=3)
