"""The CPU prefill kernel (C with AMX or AVX512-BF16, via ctypes) against the torch reference on the same paged
cache: fresh prompts, chunks after a cached prefix, single queries, lengths off the 16/32 grid.

Unowned cache slots hold NaN (see paged_batches.py), so a read past a sequence's end or through a
wrong block-table entry poisons the output.
"""

import pytest
import torch
from paged_batches import BATCH_KINDS, make_paged_batch

from kubeinfer.kernels.cpu import paged_prefill_cpu
from kubeinfer.kernels.reference.attention_ref import paged_attention_ref

# native: AMX tiles where the CPU has them; avx512: the vdpbf16ps path (an AVX2-only CPU keeps
# torch's SDPA: test_cpu_isa.py)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cpu_isa"), pytest.mark.cpu_isas("native", "avx512")]
TOLERANCE = 2e-2   # bf16 probabilities and output, float32 sums

CASES = {
    **BATCH_KINDS,
    "long-prompts": [(544, 0), (544, 0), (300, 0), (33, 0)],
    "chunks-after-prefix": [(32, 512), (32, 512), (200, 344), (1, 100), (17, 31)],
    "block-edges": [(16, 0), (32, 0), (31, 1), (48, 16), (64, 64)],
}


def _run(batch):
    starts = batch.query_start_loc[:-1]
    query_lens = batch.query_start_loc[1:] - starts
    scale = batch.q.shape[-1] ** -0.5
    got = paged_prefill_cpu.paged_prefill(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.seq_lens, query_lens, starts, scale)
    return got, paged_attention_ref(*batch.args(), scale)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(kind, heads, kv_heads, head_dim, block_size):
    batch = make_paged_batch(CASES[kind], heads, kv_heads, head_dim, block_size, torch.bfloat16)
    got, want = _run(batch)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


# Sequences whose first blocks are another's, as the prefix cache shares a prompt's blocks.
SHARING = [(32, 512), (32, 512), (200, 344), (32, 512), (5, 40), (1, 100)]


@pytest.mark.parametrize("block_size", [16, 32])
def test_sequences_sharing_prefix_blocks(block_size):
    """The kernel packs a shared 32-key window once and every sharer reads that packing; a window
    only partly shared, or not full in one of the sequences, must still be packed per sequence."""
    batch = make_paged_batch(SHARING, 9, 3, 64, block_size, torch.bfloat16, seed=7)

    def share(follower: int, leader: int, keys: int) -> None:
        blocks = keys // block_size
        batch.block_tables[follower, :blocks] = batch.block_tables[leader, :blocks]

    share(1, 0, 512)     # the whole prefix
    share(3, 1, 512)     # through a sequence that shares it too
    share(2, 0, 336)     # ends inside a 32-key window
    share(4, 0, 48)      # the second window is not full in the 45-token sequence
    share(5, 4, 32)      # one 16-key block of a window (block size 16), or one whole window (32)
    got, want = _run(batch)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


def test_strided_queries_are_read_in_place():
    """q as the engine has it: a view into the fused qkv projection, rows further apart than H x D."""
    batch = make_paged_batch(CASES["chunks-after-prefix"], 9, 3, 64, 16, torch.bfloat16)
    fused = torch.cat([batch.q.flatten(1), torch.randn(batch.q.shape[0], 2 * 3 * 64).to(torch.bfloat16)], 1)
    batch.q = fused[:, :9 * 64].view(-1, 9, 64)
    assert not batch.q.is_contiguous()
    got, want = _run(batch)
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


def test_refuses_unsupported_shapes():
    batch = make_paged_batch(CASES["prefill"], 9, 3, 64, 16, torch.bfloat16)
    assert not paged_prefill_cpu.available(torch.float32, 64)
    assert not paged_prefill_cpu.available(torch.bfloat16, 96)
    starts = batch.query_start_loc[:-1]
    too_long = batch.seq_lens + 1   # more queries than tokens: refused, not read out of bounds
    with pytest.raises(ValueError, match="refused"):
        paged_prefill_cpu.paged_prefill(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                        batch.seq_lens, too_long, starts, 0.125)
