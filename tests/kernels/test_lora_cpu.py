"""The CPU multi-LoRA kernel (kernels/cpu/lora_cpu.c) against a plain per-token loop:
out[t] += x[t] @ A[slot(t)].T @ B[slot(t)].T, slot -1 = no delta, for merged layers whose
shards have their own ranks (0 = not targeted), under every ISA variant this CPU can run."""

import pytest
import torch
from helpers.lora_adapters import per_token_delta

from kubeinfer.kernels.cpu import lora_cpu
from kubeinfer.kernels.reference.lora_ref import lora_shrink_expand_ref

pytestmark = pytest.mark.integration

# float32: op order only; bfloat16: the kernel rounds the shrink to bf16 for the expand (as torch's
# bf16 matmul does) and out + delta once, the loop stays in float32
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _weights(generator, num_slots, k, sizes, max_rank, ranks, dtype):
    """a [S, n R, K], b [S, N, n R] as `LoRALayer` holds them (rank blocks zero-padded, shard i's B
    in its own rows and rank block) and the ranks [S, n] tensor."""
    n = sum(sizes)
    a = torch.zeros(num_slots, len(sizes) * max_rank, k)
    b = torch.zeros(num_slots, n, len(sizes) * max_rank)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for slot in range(num_slots):
        for shard, (start, size) in enumerate(zip(starts, sizes)):
            rank = ranks[slot][shard]
            block = slice(shard * max_rank, shard * max_rank + rank)
            a[slot, block] = torch.randn(rank, k, generator=generator) / k ** 0.5
            b[slot, start:start + size, block] = torch.randn(size, rank, generator=generator) / max(rank, 1) ** 0.5
    return a.to(dtype), b.to(dtype), torch.tensor(ranks, dtype=torch.int32), [*starts, n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, sizes, ranks, slots_per_token", [
    pytest.param(64, [96], [[8], [8], [8]], [0, 1, -1, 2, 1, 0], id="decode-mixed-with-base"),
    pytest.param(96, [64, 32, 32], [[16, 16, 16], [8, 0, 8], [0, 0, 0], [16, 4, 1]],
                 [0, 1, 2, 3] * 9 + [-1, 3], id="merged-qkv-ranks-per-shard"),
    pytest.param(72, [300, 300], [[16, 16], [12, 12]], [1] * 40 + [-1] * 5 + [0] * 19,
                 id="prefill-segments-columns-past-a-chunk"),
    pytest.param(40, [17], [[3], [5]], [-1] * 9, id="base-only"),
    pytest.param(200, [33, 7], [[16, 1], [2, 16], [16, 16], [1, 1]], [3, 3, -1, -1, 3, 1, 0, 2] * 20,
                 id="odd-sizes-many-tokens-per-slot"),
    pytest.param(48, [40, 24], [[5, 5], [3, 0]], [0, 1, 1, 0, 0], id="odd-max-rank"),
])
def test_lora_add_matches_per_token_loop(cpu_isa, k, sizes, ranks, slots_per_token, dtype):
    generator = torch.Generator().manual_seed(len(slots_per_token))
    num_slots, tokens = len(ranks), len(slots_per_token)
    max_rank = 5 if max(map(max, ranks)) == 5 else 16
    a, b, rank_tensor, bounds = _weights(generator, num_slots, k, sizes, max_rank, ranks, dtype)
    # x a column slice of a wider tensor (row stride != K), as a view of a fused output would be
    x = torch.randn(tokens, k + 5, generator=generator).to(dtype)[:, 2:k + 2]
    out = torch.randn(tokens, sum(sizes), generator=generator).to(dtype)
    expected = per_token_delta(x, out, a, b, slots_per_token)
    indices = torch.tensor(slots_per_token, dtype=torch.int32)
    order, slot_starts = lora_cpu.token_order(indices, num_slots)
    bt = lora_cpu.compact_b(b, bounds, max_rank)
    slots = lora_cpu.LoRASlots(a, bt, rank_tensor, torch.tensor(bounds, dtype=torch.int64))
    got = slots.add(x, out.clone(), order, slot_starts)
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    base_rows = [t for t, slot in enumerate(slots_per_token) if slot < 0]
    assert torch.equal(got[base_rows], out[base_rows])
    # the segmented torch reference agrees on the same (uncompacted) weights
    reference = out.clone()
    for t, slot in enumerate(slots_per_token):
        lora_shrink_expand_ref(x[t:t + 1], reference[t:t + 1], a, b, torch.tensor([0, 1]), torch.tensor([slot]))
    torch.testing.assert_close(got.float(), reference.float(), atol=TOLERANCES[dtype] * 2, rtol=TOLERANCES[dtype])


def test_token_order_groups_tokens_by_slot_and_leaves_the_base_out():
    order, starts = lora_cpu.token_order(torch.tensor([2, -1, 0, 2, -1, 0, 1], dtype=torch.int32), 4)
    assert order.tolist() == [2, 5, 6, 0, 3] and order.dtype == torch.int32
    assert starts.tolist() == [0, 2, 3, 5, 5] and starts.dtype == torch.int64


def test_compact_b_keeps_each_shards_own_block():
    b = torch.zeros(1, 5, 4)   # shards of 3 and 2 rows, rank 2: shard 0 in columns 0-1, shard 1 in 2-3
    b[0, :3, :2] = torch.arange(6.).view(3, 2)
    b[0, 3:, 2:] = torch.arange(10., 14.).view(2, 2)
    blocked = lora_cpu.compact_b(b, [0, 3, 5], 2)
    assert blocked.shape == (1, 1, 1, 32, 2) and not blocked[..., 5:, :].any()
    assert blocked[0, 0, 0, :5].T.tolist() == [[0., 2., 4., 10., 12.], [1., 3., 5., 11., 13.]]


def test_a_layout_the_kernel_does_not_take_is_refused_before_anything_is_written(cpu_isa):
    a, b, ranks, bounds = _weights(torch.Generator().manual_seed(0), 2, 8, [4], 4, [[4], [4]], torch.float32)
    bt = lora_cpu.compact_b(b, bounds, 4)
    with pytest.raises(ValueError, match="layout of kernels/cpu/lora_cpu.c"):
        lora_cpu.LoRASlots(a, bt.to(torch.bfloat16), ranks, torch.tensor(bounds))
    with pytest.raises(ValueError, match="layout of kernels/cpu/lora_cpu.c"):
        lora_cpu.LoRASlots(a, bt[:, :, :1].contiguous(), ranks, torch.tensor(bounds))   # rank 2, A has 4
    slots = lora_cpu.LoRASlots(a, bt, ranks, torch.tensor(bounds))
    order, starts = lora_cpu.token_order(torch.tensor([0, 1], dtype=torch.int32), 2)
    out = torch.zeros(2, 4)
    for x, into in ((torch.zeros(2, 8, dtype=torch.bfloat16), out), (torch.zeros(2, 8), out.t()),
                    (torch.zeros(2, 7), out)):
        with pytest.raises(ValueError, match="rows of the slots' dtype"):
            slots.add(x, into, order, starts)
    assert not out.any()
