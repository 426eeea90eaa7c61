"""Multi-LoRA on the CPU: the C kernel of `lora_cpu.c` (built by `cpu_build`), which adds every
token's adapter delta to a layer's output in one call, reading each slot's matrices once for all
of its tokens and only the ranks each adapter has (see the C file for the layouts).

`compact_b` turns the usual B [S, N, n * R] (shard i's rank block in its own output rows, as
`lora_ref` and the Triton SGMV take it) into the kernel's B transposed [S, R, N]; `token_order`
turns per-token slots into the kernel's token order and per-slot bounds.
"""

from __future__ import annotations

import torch

from . import cpu_build

_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@cpu_build.per_isa
def _function(dtype: torch.dtype):
    library = cpu_build.load("lora_cpu")
    if library is None or dtype not in _SUFFIX:
        return None
    return cpu_build.bind(library, f"lora_add_{_SUFFIX[dtype]}", pointers=8, ints=7)


def available(dtype: torch.dtype) -> bool:
    """Whether `lora_add` runs for CPU tensors of `dtype` (builds the kernel on first call)."""
    return _function(dtype) is not None


def building() -> bool:
    """Whether the kernel is still compiling in the background (`cpu_build.start_building`)."""
    return cpu_build.building("lora_cpu")


def compact_b(b: torch.Tensor, bounds: list[int], max_rank: int) -> torch.Tensor:
    """B [S, N, n * R] -> [S, R, N]: column c of shard i (bounds[i] <= c < bounds[i + 1]) takes
    its rank block i (the blocks of other shards are zero in B, so nothing is lost)."""
    out = b.new_zeros(b.shape[0], max_rank, b.shape[1])
    for shard, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        block = b[:, start:stop, shard * max_rank:(shard + 1) * max_rank]
        out[:, :, start:stop] = block.transpose(1, 2)
    return out


def token_order(slots_per_token: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices grouped by slot, slot -1 left out: int32; each slot's bounds in them [S + 1]: int64)."""
    slots = slots_per_token.to(torch.int64)
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots + 1, minlength=num_slots + 1)
    bounds = torch.cumsum(counts, 0) - counts[0]   # the base model's tokens sort first
    return order[int(counts[0]):].to(torch.int32), bounds[:num_slots + 1].contiguous()


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, order: torch.Tensor,
             slot_starts: torch.Tensor, ranks: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """out[t] += (x[t] @ a[s].T) restricted per shard to its rank, @ B[s].T, in place, for every
    token t of slot s in `order`; returns out.

    x [T, K] and out [T, N] with unit column stride; a [S, n * R, K], bt [S, R, N] contiguous, of
    x's dtype; order int32 (token indices, grouped by slot), slot_starts int64 [S + 1], ranks int32
    [S, n], bounds int64 [n + 1] (the shards' first output columns, then N)."""
    num_slots, width, k = a.shape
    num_shards, max_rank, n = ranks.shape[1], bt.shape[1], bt.shape[2]
    if not (x.device.type == out.device.type == "cpu" and x.dtype == out.dtype == a.dtype == bt.dtype
            and x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and bt.is_contiguous()
            and x.shape[1] == k and out.shape[1] == n and width == num_shards * max_rank
            and bt.shape[0] == num_slots and ranks.shape[0] == num_slots and ranks.is_contiguous()
            and ranks.dtype == order.dtype == torch.int32 and slot_starts.dtype == bounds.dtype == torch.int64
            and slot_starts.shape[0] == num_slots + 1 and bounds.shape[0] == num_shards + 1
            and order.is_contiguous() and slot_starts.is_contiguous() and bounds.is_contiguous()):
        raise ValueError("lora_add: tensors do not have the layout of kernels/lora_cpu.c")
    status = _function(x.dtype)(x.data_ptr(), out.data_ptr(), a.data_ptr(), bt.data_ptr(), order.data_ptr(),
                                slot_starts.data_ptr(), ranks.data_ptr(), bounds.data_ptr(), num_slots, num_shards,
                                max_rank, k, n, x.stride(0), out.stride(0))
    if status:
        raise MemoryError("lora_add: no memory for the shrink")
    return out
