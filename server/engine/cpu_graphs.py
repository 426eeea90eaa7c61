"""Decode steps replayed on the CPU from recorded kernel calls, the CPU's CUDA graphs.

On the CPU every op of a decode layer is one of our C kernels (`kernels/cpu/cpu_build.py`) for a
W8A8 or GGUF model, and what is left around them is Python: module calls, checks, allocations
and ctypes conversions. SmolLM2 W8A8 at 32 sequences spent a quarter of its decode step outside
the kernels on the engine thread while the other OpenMP thread waited (BENCHMARKS.md, "Decode
steps replayed from recorded kernel calls"). So, like `cuda_graphs.py`, a decode step runs in
static buffers of its padded batch size; the first step of each size runs its layers, then runs
them again recording their kernel calls (`cpu_build.recording_calls`); later steps of that size
copy their inputs in and make the same calls with the same arguments, without the Python between
them.

What makes that safe: while recording, a dispatch mode refuses every torch op other than an
allocation or a view (an op that computes, copies or reads a value into Python would not be
replayed), and keeps every tensor the layers allocate alive for the replays. A size whose layers
run such an op (bf16 linears on oneDNN, LoRA, a MoE router) stays eager. The step's own inputs
are in the static buffers; the per-step values the layers derive from them are the attention
backend's layout (views of the same buffers) and the rotary cos/sin, recomputed into the
recorded tensors before each replay. The embedding lookup before the layers and the final norm
and lm_head after them run in torch as they do eagerly.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kubeinfer.kernels import ops_cpu

from ..model.families.llama import LlamaForCausalLM
from ..model.forward_batch import ForwardBatch
from .cuda_graphs import DecodeGraphs, host_dependent_rotary, why_eager

log = logging.getLogger(__name__)

# What the recorded sizes may keep allocated together (their layers' activations, per size: a
# replay writes where its recording did). SmolLM2-135M at every size up to 64 sequences holds
# ~110 MB; a 7B model ~4.7 MB a sequence, so this stops at a few hundred recorded sequences.
RECORDED_BYTES = 1 << 30
ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
               torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default}


def why_not_graphed(model: nn.Module, *, device: torch.device, enforce_eager: bool, enable_lora: bool,
                    calculate_kv_scales: bool, tensor_parallel_size: int) -> str | None:
    """None when CPU decode steps may be recorded (each size is still checked as it records)."""
    if device.type != "cpu":
        return "not on the CPU"
    reason = why_eager(enforce_eager=enforce_eager, enable_lora=enable_lora,
                       calculate_kv_scales=calculate_kv_scales, tensor_parallel_size=tensor_parallel_size)
    if reason is not None:
        return reason
    if not isinstance(model, LlamaForCausalLM) or type(model).hidden_states is not LlamaForCausalLM.hidden_states:
        return "a model family with its own forward pass"
    if type(model.model.embed_tokens) is not nn.Embedding:
        return "an embedding other than a plain lookup table"
    return host_dependent_rotary(model.model.rotary_emb)


class RecordingRefused(RuntimeError):
    """The layers ran a torch op that a replay of their kernel calls would skip."""


class _OnlyKernels(TorchDispatchMode):
    """Refuses torch ops that compute, copy, write or read values; keeps every tensor made."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []
        self.allocated_bytes = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Nothing under this mode is compiled; the default wraps the hook in dynamo's disable,
        whose first use imports torch._dynamo: 0.9 s inside a server's first decode step."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        outputs = tree_flatten(out)[0]
        if func in ALLOCATIONS:
            self.allocated_bytes += out.untyped_storage().nbytes()
        else:
            inputs = {_storage(value) for value in tree_flatten((args, kwargs))[0]} - {None}
            if func._schema.is_mutable or not outputs or not all(_storage(value) in inputs for value in outputs):
                raise RecordingRefused(f"the decoder layers run {func}")
        self.tensors += [value for value in outputs if isinstance(value, torch.Tensor)]
        return out


def _storage(value: object) -> int | None:
    """Where a tensor's memory starts (None: not a tensor, or one without plain storage, as
    oneDNN's packed weights)."""
    if not isinstance(value, torch.Tensor) or value.is_mkldnn:
        return None
    try:
        return value.untyped_storage().data_ptr()
    except NotImplementedError:
        return None


@dataclass
class _Recorded:
    """One padded size's decode layers: their kernel calls, the tensors those calls point into,
    and where the step's embeddings go in and the last layer's output comes out."""

    calls: list[tuple[ctypes._CFuncPtr, tuple]]
    tensors: list[torch.Tensor]
    embedded: torch.Tensor                    # [size, hidden]: the first layer's input
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # the rotary tables the calls read
    out: tuple[torch.Tensor, torch.Tensor]    # the last layer's (x, residual)


class CpuDecodeGraphs(DecodeGraphs):
    """Static decode inputs per padded batch size (as `DecodeGraphs`), each size recorded at its
    first step (`_record`) and replayed after (`_replay`); `refused` sizes run eagerly."""

    # a padded sequence is a one-token decode reading one key (slot 0 of its stale table): what
    # the CPU decode kernel runs for it, no empty softmax, and a static batch that is consistent
    PADDED_DECODES = True

    def __init__(self, model: LlamaForCausalLM, kv_caches: list, *, max_num_seqs: int, max_model_len: int,
                 block_size: int, num_blocks: int) -> None:
        super().__init__(model, kv_caches, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         block_size=block_size, num_blocks=num_blocks, device=torch.device("cpu"))
        self.recorded: dict[int, _Recorded] = {}
        self.refused: set[int] = set()
        self.held_bytes = 0   # by the recorded sizes' tensors
        self._batches: dict[int, ForwardBatch] = {}   # one object per size: the backends key their layout on it

    def fits(self, query_lens: list[int], longest_block_table: int) -> bool:
        """A decode step of a recorded size, or of one to record: not while a starting server
        still compiles a kernel (its layers would take torch's path and the size be refused)."""
        if not super().fits(query_lens, longest_block_table):
            return False
        size = self.padded_size(len(query_lens))
        return size in self.recorded or (size not in self.refused
                                         and not ops_cpu.any_kernel_building())

    @torch.inference_mode()
    def replay(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
               seq_lens: np.ndarray) -> torch.Tensor | None:
        """float32 logits [S, vocab] of a decode step of S sequences (one token each, in order);
        None when this step's size was just refused (the caller runs the step eagerly)."""
        count, size = self.fill(input_ids, positions, slots, block_tables, seq_lens)
        recorded = self.recorded.get(size)
        if recorded is None:
            recorded = self._record(size)
            if recorded is None:
                return None
        else:
            self._replay(recorded, size)
        return self.model.logits(self.model.final_norm(*recorded.out, self.logits_indices[:count]))

    def _record(self, size: int) -> _Recorded | None:
        """Run this step's layers on the static batch, then again while recording their kernel
        calls. The first run does what a layer does once (packs a weight at its first use) or once
        a step (the rotary tables, the backends' layout); the second stores the same K/V in the
        same slots, and its output is the step's. None, and eager from now on, if the layers run
        a torch op: the caller then runs the step eagerly."""
        model, batch = self.model, self._batches.setdefault(size, self._batch(size))
        embedded = model.model.embed_tokens(batch.input_ids)
        model.decoder_layers(embedded, batch, self.kv_caches)
        guard = _OnlyKernels()
        try:
            with ops_cpu.recording_calls() as calls, guard:
                out = model.decoder_layers(embedded, batch, self.kv_caches)
        except RecordingRefused as refused:
            self.refused.add(size)
            log.info("decode steps of %d sequences run eagerly: %s", size, refused)
            return None
        held = guard.allocated_bytes
        if held + self.held_bytes > RECORDED_BYTES:
            self.refused.add(size)
            log.info("decode steps of %d sequences run eagerly: recording them would hold %d MiB of activations, "
                     "%d MiB more than the recorded sizes may", size, held >> 20,
                     (held + self.held_bytes - RECORDED_BYTES) >> 20)
            return None
        self.held_bytes += held
        cos_sin = model.model.rotary_emb.step_cos_sin(batch, embedded.dtype)
        self.recorded[size] = _Recorded(calls, guard.tensors, embedded, cos_sin, out)
        log.info("recorded the decode step of %d sequences: %d kernel calls, %d MiB of activations held",
                 size, len(calls), held >> 20)
        return self.recorded[size]

    def _replay(self, recorded: _Recorded, size: int) -> None:
        """The step's embeddings and rotary tables into the recorded tensors, then every call."""
        model = self.model
        torch.index_select(model.model.embed_tokens.weight, 0, self.input_ids[:size], out=recorded.embedded)
        cos, sin = model.model.rotary_emb.cos_sin(self.positions[:size], recorded.embedded.dtype)
        recorded.cos_sin[0].copy_(cos)
        recorded.cos_sin[1].copy_(sin)
        for function, args in recorded.calls:
            status = function(*args)
            if status:
                raise RuntimeError(f"{function.__name__} failed in a recorded decode step (status {status})")
