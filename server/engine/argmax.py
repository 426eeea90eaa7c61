"""Row-wise argmax over the vocabulary, fast on CPU.

torch's CPU `argmax` is not vectorised (a visible part of a decode step; kernels/README.md has
the figures). `amax` is vectorised, so find the block of the vocabulary holding each row's
maximum first, then take argmax inside that block only. The result is
argmax's: the first index of the maximum (the first block holding it, the first place in it).
"""

from __future__ import annotations

import torch

BLOCK = 1024


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for `x [rows, vocab]`, as int64 `[rows]`."""
    rows, vocab = x.shape
    blocks = vocab // BLOCK
    if x.device.type != "cpu" or blocks < 2 or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    head = x[:, :blocks * BLOCK].view(rows, blocks, BLOCK)
    block_max = head.amax(dim=-1)
    best_block = block_max.argmax(dim=-1)
    row_index = torch.arange(rows, device=x.device)
    found = head[row_index, best_block].argmax(dim=-1) + best_block * BLOCK
    if vocab == blocks * BLOCK:
        return found
    tail = x[:, blocks * BLOCK:]
    in_tail = tail.amax(dim=-1) > block_max[row_index, best_block]   # ties go to the earlier head
    return torch.where(in_tail, tail.argmax(dim=-1) + blocks * BLOCK, found)
