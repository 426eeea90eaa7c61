"""A rank's part of a quantized linear layer: the compute form (`quantization/weights.py`) of the
whole checkpoint matrix, cut along the layer's role.

Every format (compressed-tensors, GPTQ, AWQ, fp8, --quantization fp8/int8) is first built into
one of three forms by the single-device code, so the cut is written once per form rather than
once per checkpoint layout (GPTQ packs along inputs, AWQ along outputs in its nibble order,
compressed-tensors packs weights along inputs and zero points along outputs):

- output features (COLUMN, KV_COLUMN, VOCAB): columns of a packed qweight and of its scales /
  zero points, rows of an int8 / fp8 weight and its per-channel scales (vocab shards padded with
  zero rows, which give zero logits that the gather cuts off);
- input features (ROW): a rank must hold whole quantization groups, since each group's scale and
  zero point apply to its inputs as a unit. Packed words are sliced when the cut falls on a word
  boundary and re-packed otherwise; GPTQ act-order (g_idx) layers are cut in input order and keep
  the groups whose inputs all landed on this rank. A cut that splits a group is refused, naming
  the layer. Per-channel (one group) and 8-bit scaled weights cut anywhere: their scales belong
  to output channels.

Dynamic activation scales (W8A8 per token, fp8 per token or per tensor) are then taken by each
rank over its own slice of a row-parallel layer's input, as in vLLM.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn import functional as F

from ..model.checkpoints.checkpoint import Slice
from ..model.quantization.weights import PackedIntWeight, QuantizedLinearWeight, ScaledWeight, pack_rows, unpack_rows


def shard_quantized(name: str, form: QuantizedLinearWeight, part: Slice | None, size: int) -> QuantizedLinearWeight:
    """This rank's `part` of checkpoint layer `name`'s compute form (None: all of it)."""
    if part is None:
        return form
    if part.dim == 0:
        return _outputs(form, part)
    return _inputs(name, form, part, size)


def _outputs(form: QuantizedLinearWeight, part: Slice) -> QuantizedLinearWeight:
    missing = part.padded - (part.stop - part.start)
    if isinstance(form, PackedIntWeight):
        def cut(tensor: torch.Tensor) -> torch.Tensor:
            return F.pad(tensor[:, part.start:part.stop], (0, missing)).contiguous()

        return replace(form, qweight=cut(form.qweight), scales=cut(form.scales), zeros=cut(form.zeros),
                       out_features=part.padded)
    weight = form.weight[part.start:part.stop]
    if missing:   # F.pad has no float8 kernel
        weight = torch.cat([weight, weight.new_zeros(missing, weight.shape[1])])
    return replace(form, weight=weight.contiguous(), scale=F.pad(form.scale[part.start:part.stop], (0, missing)))


def _inputs(name: str, form: QuantizedLinearWeight, part: Slice, size: int) -> QuantizedLinearWeight:
    if isinstance(form, ScaledWeight):
        return replace(form, weight=form.weight[:, part.start:part.stop].contiguous())
    start, stop, width = part.start, part.stop, part.stop - part.start
    in_features, group_size = form.in_features, form.group_size
    groups = -(-in_features // group_size)
    # positions in the stored (act-order sorted) row order whose input feature is this rank's
    if form.perm is None:
        positions = torch.arange(start, stop, device=form.qweight.device)
    else:
        positions = torch.nonzero((form.perm >= start) & (form.perm < stop)).flatten()
    if groups == 1:   # per-channel scales: any cut keeps them
        local_group_size, kept = width, torch.zeros(1, dtype=torch.long, device=positions.device)
    else:
        of_position = positions // group_size
        kept, counts = torch.unique_consecutive(of_position, return_counts=True)
        full = torch.clamp(in_features - kept * group_size, max=group_size)
        if not torch.equal(counts, full):
            group = int(kept[(counts != full).nonzero()[0, 0]])
            how = (f"act-order (g_idx) puts the input features of group {group} on more than one rank"
                   if form.perm is not None else f"its input features {start}..{stop - 1} on this rank split group "
                   f"{group}")
            raise ValueError(f"{name}: tensor parallel size {size} cannot split this {form.bits}-bit layer by input "
                             f"features: {how} (each group of {group_size} inputs shares a scale, so a group must "
                             "not span ranks); use a tensor parallel size that cuts its inputs into whole groups")
        local_group_size = group_size
    per_word = 32 // form.bits
    if form.perm is None and start % per_word == 0 and (stop % per_word == 0 or stop == in_features):
        qweight = form.qweight[start // per_word:-(-stop // per_word)]
    else:   # the cut falls inside packed words (or act-order rows): unpack this rank's rows, pack again
        qweight = pack_rows(unpack_rows(form.qweight, form.bits, in_features)[positions], form.bits)
    perm = None
    if form.perm is not None:
        perm = form.perm[positions] - start
        if torch.equal(perm, torch.arange(width, device=perm.device)):
            perm = None
    return replace(form, qweight=qweight.contiguous(), scales=form.scales[kept].contiguous(),
                   zeros=form.zeros[kept].contiguous(), group_size=local_group_size, in_features=width, perm=perm)
