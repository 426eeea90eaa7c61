"""LoRA slots inside the model: every decoder Linear gets a `LoRALayer` that adds each token's
adapter delta, x @ A[slot].T @ B[slot].T, to the layer's output.

A layer holds `max_loras` device slots, A [slots, n * max_rank, in] and B [slots, out,
n * max_rank] for a layer that stacks n checkpoint matrices (q|k|v, gate|up): shard i's A
rows are block i of the rank axis and its B lives in its own output rows, so a merged layer
costs one shrink and one expand per slot, whatever its adapters target. Ranks below the
maximum are zero-padded. Every step, `LoRABatch.set` turns `ForwardBatch.adapter_indices`
into the tokens of each slot once, shared by all layers; a batch of base-model tokens only
(`adapter_indices` None) does no LoRA work at all.

Tensor parallelism slices A and B like the weight they patch (`weight_slices`): a column
layer's B by output rows, a row layer's A by input columns, its delta added before the
all-reduce (`RowParallelLinear`), which sums the partial shrinks.

On CUDA the per-slot matmuls are the Triton SGMV kernel (`kubeinfer.kernels.triton.lora`). On the
CPU the C kernel `kubeinfer.kernels.cpu.lora_cpu` adds every token's delta in one call a layer,
reading each slot's A and B (kept transposed and compacted, `bt`) once for all its tokens and
only the ranks each adapter has. Should that raise (or the kernel not be built yet), the slots
are computed one by one in torch inside a guard: a slot whose delta raises is recorded in
`LoRABatch.failed`, and the engine fails only that adapter's requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from kubeinfer.kernels import ops, ops_cpu

from ..forward_batch import ForwardBatch
from ..layers.linear import Linear, MergedLinear, ParallelRole, can_pack, linear, pack_weight
from .lora import LoRAError, LoRAWeights

if TYPE_CHECKING:
    from ..checkpoints.checkpoint import Slice

log = logging.getLogger(__name__)


class LoRABatch:
    """This step's token -> slot mapping, shared by every LoRA layer of a model."""

    def __init__(self, num_slots: int, dtype: torch.dtype) -> None:
        self.num_slots, self.dtype = num_slots, dtype
        self.active = False
        self.indices: torch.Tensor | None = None                  # [T] slot per token, -1 = base
        self.order: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU kernel: tokens by slot, slot bounds
        self.segments: tuple[torch.Tensor, torch.Tensor, int] | None = None  # Triton: starts, slots, longest
        self._rows: list[tuple[int, slice | torch.Tensor]] | None = None
        self.failed: dict[int, BaseException] = {}               # slot -> what its delta raised

    def set(self, batch: ForwardBatch) -> None:
        indices = batch.adapter_indices
        self.failed, self._rows, self.order, self.segments = {}, None, None, None
        self.active = indices is not None and bool(indices.numel())
        if not self.active:
            return
        assert indices is not None
        self.indices = indices
        if ops.uses_triton(indices):
            starts, slots = self._runs()
            longest = max(b - a for a, b in zip(starts, starts[1:]))
            self.segments = (torch.tensor(starts, dtype=torch.int32, device=indices.device),
                             torch.tensor(slots, dtype=torch.int32, device=indices.device), longest)
        elif indices.device.type == "cpu" and ops_cpu.lora_kernel_ready(self.dtype):
            self.order = ops_cpu.lora_token_order(indices, self.num_slots)

    def _runs(self) -> tuple[list[int], list[int]]:
        """Runs of equal slot in token order (a sequence's tokens are contiguous): starts + end, slots."""
        assert self.indices is not None
        host = self.indices.tolist()
        starts, slots = [0], []
        for i, slot in enumerate(host):
            if i and slot != host[i - 1]:
                starts.append(i)
            if i == 0 or slot != host[i - 1]:
                slots.append(slot)
        starts.append(len(host))
        return starts, slots

    @property
    def rows(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, its token rows) for the slot-by-slot torch path, built the first time it is needed."""
        if self._rows is None:
            starts, slots = self._runs()
            runs: dict[int, list[tuple[int, int]]] = {}
            for slot, a, b in zip(slots, starts, starts[1:]):
                if slot >= 0:
                    runs.setdefault(slot, []).append((a, b))
            self._rows = []
            for slot, spans in runs.items():
                if len(spans) == 1:
                    self._rows.append((slot, slice(*spans[0])))
                else:
                    rows = torch.cat([torch.arange(a, b) for a, b in spans])
                    self._rows.append((slot, rows.to(self.indices.device)))
        return self._rows


class LoRALayer:
    """The adapter slots of one Linear (a plain object, not a module: no parameters to load)."""

    def __init__(self, module: Linear, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.batch = batch
        sizes = list(module.output_sizes) if isinstance(module, MergedLinear) else [module.out_features]
        self.row_starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes, self.max_rank = sizes, max_rank
        self.a = torch.zeros(max_loras, len(sizes) * max_rank, module.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, module.out_features, len(sizes) * max_rank, dtype=dtype, device=device)
        # the CPU kernel's form: B transposed, compacted (shards share the rank rows, their columns
        # are disjoint) and blocked by 32 columns (`ops_cpu.lora_compact_b`), each slot's rank per
        # shard, the shards' first columns
        self.bt = torch.zeros(ops_cpu.lora_blocked_b_shape(max_loras, module.out_features, max_rank),
                              dtype=dtype) if device.type == "cpu" else None
        self.ranks = torch.zeros(max_loras, len(sizes), dtype=torch.int32)
        self.bounds = torch.tensor([*self.row_starts, module.out_features], dtype=torch.int64)
        self.kernel = ops_cpu.LoRASlots(self.a, self.bt, self.ranks, self.bounds) if self.bt is not None else None
        # oneDNN-prepacked copies (CPU bf16, as the base weights: see linear.py), refreshed on write
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [r, in], B [rows, r]) per shard, None = not targeted."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot].zero_()
        for i, pair in enumerate(shards):
            if pair is None:
                continue
            a, b = pair
            rank, start = a.shape[0], i * self.max_rank
            self.a[slot, start:start + rank].copy_(a)
            self.b[slot, self.row_starts[i]:self.row_starts[i] + self.sizes[i], start:start + rank].copy_(b)
            self.ranks[slot, i] = rank
        if self.bt is not None:
            self.bt[slot] = ops_cpu.lora_compact_b(self.b[slot:slot + 1], self.bounds.tolist(), self.max_rank)[0]
        if can_pack(self.a):
            self.packed[slot] = (pack_weight(self.a[slot]), pack_weight(self.b[slot]))

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each token's delta (in place; `out` is the layer's fresh output)."""
        batch = self.batch
        if not batch.active:
            return
        if batch.segments is not None:
            starts, slots, longest = batch.segments
            ops.lora_shrink_expand(x, out, self.a, self.b, starts, slots, longest)
            return
        if batch.order is not None and self.kernel is not None and not batch.failed:
            try:   # every slot's tokens in one kernel call; it writes `out` only once it cannot fail
                lora_add_all(x, out, self, *batch.order)
                return
            except Exception:  # noqa: BLE001 - slot by slot below, to find whose delta fails
                pass
        for slot, rows in batch.rows:
            if slot in batch.failed:
                continue
            try:
                delta = lora_delta(x[rows], self.a[slot], self.b[slot], self.packed.get(slot))
            except Exception as error:  # noqa: BLE001 - fails that adapter's requests only
                batch.failed[slot] = error
                continue
            if isinstance(rows, slice):
                out[rows] += delta.to(out.dtype)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))


Packed = tuple[torch.Tensor, torch.Tensor] | None   # oneDNN copies of (A, B), or None


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, packed: Packed = None) -> torch.Tensor:
    """(x @ A.T) @ B.T for one slot's rows: the seam tests replace to make one adapter fail."""
    a_packed, b_packed = packed or (None, None)
    return linear(linear(x.to(a.dtype), a, a_packed), b, b_packed)


def lora_add_all(x: torch.Tensor, out: torch.Tensor, layer: LoRALayer, order: torch.Tensor,
                 slot_starts: torch.Tensor) -> None:
    """out += every token's delta at once (the CPU kernel): the seam tests replace to make the
    batch of a failing adapter fall back to the slot-by-slot path."""
    assert layer.kernel is not None
    layer.kernel.add(x, out, order, slot_starts)


class LoRAModel:
    """The LoRA layers of one model (or one tensor-parallel rank's shard) and how to fill a slot.

    `dtype` is the model's compute dtype (adapters of a quantized model run in it too);
    `slices`: this rank's checkpoint slices (`parallel.model.weight_slices`), None without TP."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 slices: "dict[str, Slice] | None" = None) -> None:
        self.batch = LoRABatch(max_loras, dtype)
        self.max_loras, self.max_rank, self.slices = max_loras, max_rank, slices or {}
        # checkpoint module name -> (its layer, shard index inside it)
        self.targets: dict[str, tuple[LoRALayer, int]] = {}
        self.fused: dict[str, LoRALayer] = {}   # a merged layer named as a whole (Phi-3's qkv_proj)
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module.role is ParallelRole.VOCAB:
                continue
            layer = LoRALayer(module, self.batch, max_loras, max_rank, dtype, device)
            module.lora = layer
            for i, (source, shard) in enumerate(model.checkpoint_sources(name, module)):
                self.targets[source] = (layer, shard if shard is not None else i)
            if isinstance(module, MergedLinear):
                self.fused[name] = layer
        model.register_forward_pre_hook(lambda _, args: self.batch.set(args[0]))

    def check(self, weights: LoRAWeights) -> None:
        """Refuse an adapter whose modules this model lacks or whose shapes are another model's."""
        for module, (a, b) in weights.modules.items():
            self._shards(weights.name, module, a, b)

    def write(self, slot: int, weights: LoRAWeights | None) -> None:
        """Put `weights` into device slot `slot` of every layer (None: clear it)."""
        per_layer: dict[int, tuple[LoRALayer, list]] = {}
        for layer, _ in self.targets.values():
            per_layer.setdefault(id(layer), (layer, [None] * len(layer.sizes)))
        for module, (a, b) in (weights.modules.items() if weights is not None else ()):
            for layer, shard, pair in self._shards(weights.name, module, a, b):
                per_layer[id(layer)][1][shard] = pair
        for layer, shards in per_layer.values():
            layer.write(slot, shards)

    def _shards(self, adapter: str, module: str, a: torch.Tensor, b: torch.Tensor
                ) -> list[tuple[LoRALayer, int, tuple[torch.Tensor, torch.Tensor]]]:
        """(layer, shard, (A, B) as this rank holds them) for checkpoint module `module`."""
        if module in self.targets:
            layer, shard = self.targets[module]
            parts = [(layer, shard, self._slice(module, a, b))]
        elif module in self.fused and not self.slices:
            layer = self.fused[module]
            rows = layer.sizes
            if b.shape[0] != sum(rows):
                raise LoRAError(f"LoRA adapter {adapter!r}: {module} lora_B has {b.shape[0]} output rows, the "
                                f"model's layer {sum(rows)} (an adapter of another base model?)")
            parts = [(layer, i, (a, part)) for i, part in enumerate(b.split(rows))]
        elif module in self.fused:
            raise LoRAError(f"LoRA adapter {adapter!r}: {module} targets a fused checkpoint matrix, not supported with "
                            "tensor parallelism yet")
        else:
            leaf = module.rpartition(".")[2]
            if leaf in ("lm_head", "embed_tokens"):
                raise LoRAError(f"LoRA adapter {adapter!r}: target module {leaf} is not supported (only the "
                                "decoder's attention and MLP projections)")
            raise LoRAError(f"LoRA adapter {adapter!r}: the model has no module {module} to apply it to "
                            "(an adapter of another base model, or an unsupported target)")
        for layer, shard, (part_a, part_b) in parts:
            want_in, want_out = layer.a.shape[2], layer.sizes[shard]
            if part_a.shape[1] != want_in or part_b.shape[0] != want_out:
                raise LoRAError(f"LoRA adapter {adapter!r}: {module} maps {part_a.shape[1]} -> {part_b.shape[0]} "
                                f"features, the model's layer {want_in} -> {want_out} (an adapter of another base "
                                "model?)")
        return parts

    def _slice(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        part = self.slices.get(f"{module}.weight")
        if part is None:
            return a, b
        if part.dim == 0:   # column-parallel: this rank's output rows of B
            return a, b[part.start:part.stop]
        return a[:, part.start:part.stop], b   # row-parallel: this rank's input columns of A
