"""Multi-LoRA on the CPU: the C kernel of `lora_cpu.c` (built by `cpu_build`), which adds every
token's adapter delta to a layer's output in one call, reading each slot's matrices once for all
of its tokens and only the ranks each adapter has (see the C file for the layouts).

`compact_b` turns the usual B [S, N, n * R] (shard i's rank block in its own output rows, as
`lora_ref` and the Triton SGMV take it) into the kernel's blocked B transposed; `token_order`
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
    """Whether `LoRASlots.add` runs for CPU tensors of `dtype` (builds the kernel on first call)."""
    return _function(dtype) is not None


def building() -> bool:
    """Whether the kernel is still compiling in the background (`cpu_build.start_building`)."""
    return cpu_build.building("lora_cpu")


def blocked_b_shape(num_slots: int, out_features: int, max_rank: int) -> tuple[int, int, int, int, int]:
    """The kernel's B: [slots, ceil(N / 32) blocks, ceil(R / 2) rank pairs, 32 columns, 2 ranks]."""
    return num_slots, -(-out_features // 32), -(-max_rank // 2), 32, 2


def compact_b(b: torch.Tensor, bounds: list[int], max_rank: int) -> torch.Tensor:
    """B [S, N, n * R] -> the kernel's [S, ceil(N / 32), ceil(R / 2), 32, 2]: column c of shard i
    (bounds[i] <= c < bounds[i + 1]) takes its rank block i (the blocks of other shards are zero
    in B, so nothing is lost); rank j of column c sits in block c // 32, pair j // 2, lane c % 32,
    element j % 2. Padding columns and ranks are zero."""
    num_slots, blocks, pairs, _, _ = blocked_b_shape(b.shape[0], b.shape[1], max_rank)
    rows = b.new_zeros(num_slots, 2 * pairs, blocks * 32)
    for shard, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        rows[:, :max_rank, start:stop] = b[:, start:stop, shard * max_rank:(shard + 1) * max_rank].transpose(1, 2)
    return rows.view(num_slots, pairs, 2, blocks, 32).permute(0, 3, 1, 4, 2).contiguous()


def token_order(slots_per_token: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices grouped by slot, slot -1 left out: int32; each slot's bounds in them [S + 1]: int64)."""
    slots = slots_per_token.to(torch.int64)
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots + 1, minlength=num_slots + 1)
    bounds = torch.cumsum(counts, 0) - counts[0]   # the base model's tokens sort first
    return order[int(counts[0]):].to(torch.int32), bounds[:num_slots + 1].contiguous()


class LoRASlots:
    """One layer's adapter slots in the kernel's layout, checked once (the engine calls `add`
    for every LoRA layer of every step, so a call checks only what changes: x and out).

    a [S, n * R, K] and bt [S, ceil(N / 32), ceil(R / 2), 32, 2] (`compact_b`) contiguous, of one dtype;
    ranks int32 [S, n]; bounds int64 [n + 1] (the shards' first output columns, then N). The
    tensors are written in place afterwards (a slot filled), never replaced."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, ranks: torch.Tensor, bounds: torch.Tensor) -> None:
        num_slots, width, k = a.shape
        num_shards, n = ranks.shape[1], int(bounds[-1])
        max_rank = width // num_shards
        if not (a.device.type == bt.device.type == "cpu" and a.dtype == bt.dtype and a.is_contiguous()
                and bt.is_contiguous() and bt.shape == blocked_b_shape(num_slots, n, max_rank)
                and width == num_shards * max_rank and ranks.shape[0] == num_slots
                and ranks.dtype == torch.int32 and ranks.is_contiguous() and bounds.dtype == torch.int64
                and bounds.shape == (num_shards + 1,) and bounds.is_contiguous()):
            raise ValueError("LoRASlots: tensors do not have the layout of kernels/cpu/lora_cpu.c")
        self.dtype, self.k, self.n, self.num_slots = a.dtype, k, n, num_slots
        self._tensors = (a, bt, ranks, bounds)   # the pointers below stay valid while these live
        self._weights = (a.data_ptr(), bt.data_ptr())
        self._shape = (ranks.data_ptr(), bounds.data_ptr(), num_slots, num_shards, max_rank, k, n)

    def add(self, x: torch.Tensor, out: torch.Tensor, order: torch.Tensor, slot_starts: torch.Tensor) -> torch.Tensor:
        """out[t] += (x[t] @ A[s].T, each shard's block cut to its rank) @ B[s].T in place, for every
        token t of slot s: `order`, `slot_starts` from `token_order` (S + 1 bounds); returns out.
        x [T, K] and out [T, N] CPU tensors of the slots' dtype with unit column stride."""
        if not (x.dtype == out.dtype == self.dtype and x.device.type == out.device.type == "cpu"
                and x.dim() == out.dim() == 2 and x.shape[1] == self.k and out.shape[1] == self.n
                and x.stride(1) == 1 and out.stride(1) == 1 and slot_starts.shape[0] == self.num_slots + 1):
            raise ValueError("LoRASlots.add: x and out must be [T, K] and [T, N] rows of the slots' dtype")
        status = _function(self.dtype)(x.data_ptr(), out.data_ptr(), *self._weights, order.data_ptr(),
                                       slot_starts.data_ptr(), *self._shape, x.stride(0), out.stride(0))
        if status:
            raise MemoryError("LoRASlots.add: no memory for the shrink")
        return out
