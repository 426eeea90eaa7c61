"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a few hundred kernel launches, and on CUDA their Python and
launch overhead is what the step costs: for a random-weight 1B Llama at batch 32 on an H200 the
GPU worked a small fraction of each step (BENCHMARKS.md, "On an H200"). So, like vLLM and
SGLang, the engine captures the forward pass of a decode step once per padded batch size at
startup and replays it: a step in which every sequence adds one token (no prefill chunk, no
draft, no adapter) copies its inputs into the captured static buffers and launches one graph.

Padding: a captured size holds more sequences than the step has. The padded sequences have no
query token (their `query_start_loc` entries repeat the last one, so the attention programs
that would serve them return at once) and their tokens have slot -1 (the KV store skips them);
their rows of the output are computed from stale inputs and never read.

Split-KV decode picks its split count from the longest context, a host int that a graph cannot
see change: graphs are captured for the longest context the engine admits (`max_model_len`), so
a long sequence is always split enough; short ones pay the merge of mostly idle splits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from ..model.forward_batch import ForwardBatch
from ..model.layers.attention_triton import TritonAttention

log = logging.getLogger(__name__)

# Padded batch sizes captured (vLLM's spacing): each step replays the smallest that holds it.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Context of the synthetic decode the graphs are warmed with, so the kernels are autotuned on
# reads of a realistic length (slot -1: nothing is written to the cache).
WARMUP_CONTEXT = 2048


def why_not_graphed(model: torch.nn.Module, *, device: torch.device, enforce_eager: bool, enable_lora: bool,
                    calculate_kv_scales: bool, tensor_parallel_size: int) -> str | None:
    """None when decode steps can be captured, else why not (logged once at startup)."""
    if device.type != "cuda":
        return "not on CUDA"
    reason = why_eager(enforce_eager=enforce_eager, enable_lora=enable_lora,
                       calculate_kv_scales=calculate_kv_scales, tensor_parallel_size=tensor_parallel_size)
    if reason is not None:
        return reason
    layers = model.model.layers
    if not all(isinstance(layer.self_attn.backend, TritonAttention) for layer in layers):
        return "an attention backend other than Triton's"
    return host_dependent_rotary(model.model.rotary_emb)


def why_eager(*, enforce_eager: bool, enable_lora: bool, calculate_kv_scales: bool,
              tensor_parallel_size: int) -> str | None:
    """The engine settings that keep decode steps eager on any device (CUDA graphs or the CPU's
    recorded calls, `cpu_graphs.py`), or None."""
    if enforce_eager:
        return "--enforce-eager"
    if tensor_parallel_size > 1:
        return "more than one rank (--tensor-parallel-size or --pipeline-parallel-size > 1: collectives are not captured yet)"
    if enable_lora:
        return "--enable-lora (each step's adapter segments are host lists)"
    if calculate_kv_scales:
        return "--calculate-kv-scales (the scales are set by the first step's K/V)"
    return None


def host_dependent_rotary(rotary: torch.nn.Module) -> str | None:
    """Why a replay could not hold this rotary embedding's step tables, or None."""
    if getattr(rotary, "dynamic", None) is not None or getattr(rotary, "long_inv_freq", None) is not None:
        return "dynamic NTK or LongRoPE rotary (the step's tables depend on host-side lengths)"
    return None


class DecodeGraphs:
    """The captured decode forward passes, one per padded batch size, and their static inputs."""

    # A padded sequence has no query token and reads no key (the Triton programs that would serve
    # it return at once); `cpu_graphs.py` makes it a one-token decode of one key instead.
    PADDED_DECODES = False

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, max_num_seqs: int, max_model_len: int,
                 block_size: int, num_blocks: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_batch = min(max_num_seqs, CAPTURE_SIZES[-1])
        self.sizes = sorted({size for size in CAPTURE_SIZES if size < self.max_batch} | {self.max_batch})
        self.max_model_len, self.num_blocks = max_model_len, num_blocks
        width = -(-max_model_len // block_size)
        longs = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        ints = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
        self.input_ids, self.positions, self.slot_mapping = longs(self.max_batch), longs(self.max_batch), \
            longs(self.max_batch)
        self.block_tables, self.query_start_loc, self.seq_lens = ints(self.max_batch, width), \
            ints(self.max_batch + 1), ints(self.max_batch)
        self.logits_indices = torch.arange(self.max_batch, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}   # size -> (replay, logits)
        self._pool = None   # the captured graphs' shared memory pool

    def _batch(self, size: int) -> ForwardBatch:
        """The static buffers as the batch of `size` sequences the graph for `size` reads."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], logits_indices=self.logits_indices[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size on a synthetic decode, the largest first (the smaller ones reuse its
        memory pool)."""
        start = time.perf_counter()
        context = min(WARMUP_CONTEXT, self.max_model_len)
        blocks = -(-context // self.block_size)
        table = torch.arange(self.max_batch * blocks, device=self.block_tables.device) % self.num_blocks
        self.block_tables[:, :blocks] = table.view(self.max_batch, blocks).to(torch.int32)
        self.query_start_loc.copy_(torch.arange(self.max_batch + 1, dtype=torch.int32))
        self.seq_lens.fill_(context)
        self.positions.fill_(context - 1)
        self.slot_mapping.fill_(-1)
        for size in reversed(self.sizes):
            self.graphs[size] = self._record(self._batch(size))
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs", ",".join(map(str, self.sizes)),
                 time.perf_counter() - start)

    def _record(self, batch: ForwardBatch) -> tuple[Callable[[], None], torch.Tensor]:
        """Warm the forward pass on a side stream (compiles and autotunes its kernels at these
        shapes), then capture it; returns the replay and the logits buffer it writes."""
        side = torch.cuda.Stream(self.input_ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(batch, self.kv_caches)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model(batch, self.kv_caches)
        self._pool = graph.pool()
        torch.cuda.synchronize()
        return graph.replay, logits

    def fits(self, query_lens: list[int], longest_block_table: int) -> bool:
        """Whether a step of these sequences is a decode step a graph holds."""
        return (len(query_lens) <= self.max_batch and all(count == 1 for count in query_lens)
                and longest_block_table <= self.block_tables.shape[1])

    def replay(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
               seq_lens: np.ndarray) -> torch.Tensor:
        """float32 logits [S, vocab] of a decode step of S sequences (one token each, in order).
        The rows are the graph's output buffer: read them before the next replay."""
        count, size = self.fill(input_ids, positions, slots, block_tables, seq_lens)
        replay, logits = self.graphs[size]
        replay()
        return logits[:count]

    def padded_size(self, count: int) -> int:
        """The smallest captured batch size that holds `count` sequences."""
        return next(size for size in self.sizes if size >= count)

    def fill(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
             seq_lens: np.ndarray) -> tuple[int, int]:
        """The step's inputs copied into the static buffers of its padded size; (count, size)."""
        count, width = block_tables.shape
        size = self.padded_size(count)
        host = lambda array: torch.from_numpy(np.ascontiguousarray(array))  # noqa: E731
        self.input_ids[:count].copy_(host(input_ids))
        self.positions[:count].copy_(host(positions))
        self.slot_mapping[:count].copy_(host(slots))
        self.block_tables[:count, :width].copy_(host(block_tables))
        self.seq_lens[:count].copy_(host(seq_lens.astype(np.int32)))
        if count < size:   # padded sequences: nothing stored, their context as PADDED_DECODES says
            self.slot_mapping[count:size].fill_(-1)
            self.seq_lens[count:size].fill_(int(self.PADDED_DECODES))
        starts = np.arange(size + 1, dtype=np.int32)
        self.query_start_loc[:size + 1].copy_(host(starts if self.PADDED_DECODES else np.minimum(starts, count)))
        return count, size
