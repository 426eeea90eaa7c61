"""Torch reference of the packed-integer GEMM (`w4a16.py`), and the layout both read.

Weights [N out, K in] are stored transposed and packed along K in GPTQ's layout: int32
qweight [ceil(K / (32/bits)), N], value k of column n at bits * (k % (32/bits)) of word
k // (32/bits); scales and zero points are float32 [ceil(K / group_size), N], and
w[n, k] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n].
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def unpack_rows(qweight: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [ceil(rows * bits / 32), N] packed along rows -> int32 [rows, N] unsigned values."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    values = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(qweight.shape[0] * per_word, qweight.shape[1])[:rows]


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `unpack_rows`: unsigned values [K, N] -> int32 [ceil(K / (32/bits)), N]."""
    per_word = 32 // bits
    rows = -(-values.shape[0] // per_word) * per_word
    values = F.pad(values.to(torch.int32), (0, 0, 0, rows - values.shape[0]))
    values = values.view(rows // per_word, per_word, values.shape[1])
    packed = torch.zeros(rows // per_word, values.shape[2], dtype=torch.int32, device=values.device)
    for index in range(per_word):
        packed |= values[:, index] << (bits * index)
    return packed


def dequantize_kn(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                  in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight transposed, [K, N] in `dtype`, computed in float32."""
    q = unpack_rows(qweight, bits, in_features).float()
    groups = torch.arange(in_features, device=q.device) // group_size
    return ((q - zeros[groups]) * scales[groups]).to(dtype)


def packed_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bits: int = 4) -> torch.Tensor:
    """x [M, K] @ W.T in x's dtype: the weight dequantized to float32, the product summed in float32."""
    weight = dequantize_kn(qweight, scales, zeros, bits, group_size, x.shape[1], torch.float32)
    return (x.float() @ weight).to(x.dtype)
