"""LoRA slots inside the model: every decoder Linear gets a `LoRALayer` that adds each token's
adapter delta, x @ A[slot].T @ B[slot].T, to the layer's output.

A layer holds `max_loras` device slots, A [slots, n * max_rank, in] and B [slots, out,
n * max_rank] for a layer that stacks n checkpoint matrices (q|k|v, gate|up): shard i's A
rows are block i of the rank axis and its B lives in its own output rows, so a merged layer
costs one shrink and one expand per slot, whatever its adapters target. Ranks below the
maximum are zero-padded. Every step, `LoRABatch.set` turns `ForwardBatch.adapter_indices`
into the rows of each slot once, shared by all layers; a batch of base-model tokens only
(`adapter_indices` None) does no LoRA work at all.

Tensor parallelism slices A and B like the weight they patch (`weight_slices`): a column
layer's B by output rows, a row layer's A by input columns, its delta added before the
all-reduce (`RowParallelLinear`), which sums the partial shrinks.

On CUDA the per-slot matmuls are the Triton SGMV kernel (`kubeinfer.kernels.lora`). On the
CPU a step with one adapter runs its rows as one torch matmul pair; a step with several runs
one shrink over all slots' A, masks each token's other-slot ranks and runs one expand over all
slots' B (a few large ops beat a loop of small ones on a busy CPU). Should that raise, the
slots are computed one by one inside a guard: a slot whose delta raises is recorded in
`LoRABatch.failed`, and the engine fails only that adapter's requests.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from kubeinfer.kernels import ops

from .forward_batch import ForwardBatch
from .linear import Linear, MergedLinear, ParallelRole, can_pack, linear, pack_weight
from .lora import LoRAError, LoRAWeights

if TYPE_CHECKING:
    from .checkpoint import Slice

log = logging.getLogger(__name__)


class LoRABatch:
    """This step's token -> slot mapping, shared by every LoRA layer of a model."""

    def __init__(self, num_slots: int, dtype: torch.dtype) -> None:
        self.num_slots, self.dtype = num_slots, dtype
        self.active = False
        self.rows: list[tuple[int, slice | torch.Tensor]] = []   # torch path: (slot, its token rows)
        self.token_mask: torch.Tensor | None = None   # torch path, several slots: [T, slots] one-hot (0 = base)
        self.segments: tuple[torch.Tensor, torch.Tensor, int] | None = None  # Triton: starts, slots, longest
        self.failed: dict[int, BaseException] = {}               # slot -> what its delta raised

    def set(self, batch: ForwardBatch) -> None:
        indices = batch.adapter_indices
        self.failed = {}
        self.active = indices is not None and bool(indices.numel())
        if not self.active:
            return
        assert indices is not None
        host = indices.tolist()
        # runs of equal slot in token order (a sequence's tokens are contiguous)
        starts, slots = [0], []
        for i, slot in enumerate(host):
            if i and slot != host[i - 1]:
                starts.append(i)
            if i == 0 or slot != host[i - 1]:
                slots.append(slot)
        starts.append(len(host))
        if ops.uses_triton(indices):
            longest = max(b - a for a, b in zip(starts, starts[1:]))
            self.segments = (torch.tensor(starts, dtype=torch.int32, device=indices.device),
                             torch.tensor(slots, dtype=torch.int32, device=indices.device), longest)
            self.rows = []
            return
        self.segments = None
        self.token_mask = None
        runs: dict[int, list[tuple[int, int]]] = {}
        for slot, a, b in zip(slots, starts, starts[1:]):
            if slot >= 0:
                runs.setdefault(slot, []).append((a, b))
        self.rows = []
        for slot, spans in runs.items():
            if len(spans) == 1:
                self.rows.append((slot, slice(*spans[0])))
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(indices.device)
                self.rows.append((slot, rows))
        if len(self.rows) > 1:
            self.token_mask = torch.zeros(len(host), self.num_slots, dtype=self.dtype, device=indices.device)
            self.token_mask[indices >= 0, indices[indices >= 0].long()] = 1


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
        # the CPU path's form of all slots at once: A rows [slots * R, in] (a view) and B [out, slots * R]
        self.a_all = self.a.view(-1, module.in_features)
        self.b_all = torch.zeros(module.out_features, max_loras * len(sizes) * max_rank, dtype=dtype,
                                 device=device) if device.type == "cpu" else None
        # oneDNN-prepacked copies (CPU bf16, as the base weights: see linear.py), refreshed on write
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.packed_all: tuple[torch.Tensor, torch.Tensor] | None = None

    def write(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [r, in], B [rows, r]) per shard, None = not targeted."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, pair in enumerate(shards):
            if pair is None:
                continue
            a, b = pair
            rank, start = a.shape[0], i * self.max_rank
            self.a[slot, start:start + rank].copy_(a)
            self.b[slot, self.row_starts[i]:self.row_starts[i] + self.sizes[i], start:start + rank].copy_(b)
        if self.b_all is not None:
            width = self.b.shape[2]
            self.b_all[:, slot * width:(slot + 1) * width].copy_(self.b[slot])
        if can_pack(self.a):
            self.packed[slot] = (pack_weight(self.a[slot]), pack_weight(self.b[slot]))
            assert self.b_all is not None
            self.packed_all = (pack_weight(self.a_all), pack_weight(self.b_all))

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each token's delta (in place; `out` is the layer's fresh output)."""
        batch = self.batch
        if not batch.active:
            return
        if batch.segments is not None:
            starts, slots, longest = batch.segments
            ops.lora_shrink_expand(x, out, self.a, self.b, starts, slots, longest)
            return
        if batch.token_mask is not None and self.b_all is not None and not batch.failed:
            # several adapters: one shrink over every slot's A, the other slots' ranks masked to
            # zero per token, one expand (3 ops for the layer instead of ~5 per slot)
            try:
                out += lora_delta_all(x, self.a_all, self.b_all, batch.token_mask, self.packed_all).to(out.dtype)
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


def lora_delta_all(x: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor, token_mask: torch.Tensor,
                   packed: Packed = None) -> torch.Tensor:
    """Every token's delta with all slots' A [S * R, in] and B [out, S * R] at once: the shrink's
    other-slot ranks zeroed by `token_mask` [T, S] before the expand."""
    a_packed, b_packed = packed or (None, None)
    shrunk = linear(x.to(a_all.dtype), a_all, a_packed).view(x.shape[0], token_mask.shape[1], -1)
    return linear((shrunk * token_mask[:, :, None]).view(x.shape[0], -1), b_all, b_packed)


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
