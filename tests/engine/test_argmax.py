"""The blockwise argmax returns exactly torch's argmax: the first index of each row's maximum."""

import pytest
import torch

from kubeinfer.server.engine.argmax import BLOCK, argmax_rows

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("vocab", [7, 2 * BLOCK, 49152, 49152 + 5, 151936])
def test_equals_torch_argmax(vocab):
    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_resolve_to_the_first_index_across_blocks_and_tail():
    x = torch.zeros(4, 3 * BLOCK + 10)
    x[0, [5, BLOCK + 1]] = 1.0             # two blocks hold the maximum
    x[1, [BLOCK + 7, 3 * BLOCK + 2]] = 1.0  # a block and the tail hold it
    x[2, 3 * BLOCK + 9] = 1.0              # only the tail
    assert argmax_rows(x).tolist() == [5, BLOCK + 7, 3 * BLOCK + 9, 0]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_strided_rows():
    x = torch.randn(5, 4 * BLOCK + 3)[:, 1:]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
