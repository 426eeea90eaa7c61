"""Owns the model and its paged KV cache; turns a scheduler step into one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..model.forward_batch import ForwardBatch
from ..model.layers.kv_cache_quant import kv_cache_torch_dtype
from ..parallel.plan import kv_heads_per_rank
from .config import EngineConfig
from .cpu_graphs import CpuDecodeGraphs
from .cpu_graphs import why_not_graphed as why_not_cpu_graphed
from .cpu_threads import limit_torch_threads
from .cuda_graphs import DecodeGraphs, why_not_graphed
from .kv_cache_layout import KVCacheLayout
from .prompt_logprobs import PromptLogprobPlan, PromptLogprobs
from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import DraftPosition, SamplingRow

if TYPE_CHECKING:
    from ..model.loader import LoadedModel
    from .lora import EngineAdapters

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, loaded: "LoadedModel", config: EngineConfig,
                 prompt_logprobs: PromptLogprobs | None = None, adapters: "EngineAdapters | None" = None) -> None:
        """`prompt_logprobs`: scores the prompt positions of requests that ask (the target
        model's runner; a draft model's has none). `adapters`: the LoRA slot of each token
        (--enable-lora)."""
        self.model = loaded.model
        self.prompt_logprobs = prompt_logprobs
        self.adapters = adapters
        self.graphs: DecodeGraphs | None = None   # set by `capture_decode_graphs`
        self.device = loaded.device
        if self.device.type == "cpu":
            limit_torch_threads()
        self.dtype = loaded.dtype
        self.block_size = config.block_size
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self._kv_cache_dtype_name, self._calculate_kv_scales = config.kv_cache_dtype, config.calculate_kv_scales
        self._check_kv_cache_dtype(config.kv_cache_dtype)
        layout = kv_cache_layout(loaded, config)
        budget = self._kv_cache_budget(config)
        self.num_blocks = budget // layout.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes holds no block of "
                             f"{layout.bytes_per_block} bytes; raise --kv-cache-memory")
        self.kv_caches = layout.allocate(self.num_blocks, self.device, loaded.kv_scales, config.calculate_kv_scales)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB of %s, %d tokens)", self.num_blocks,
                 config.block_size, self.num_blocks * layout.bytes_per_block / 2**30,
                 str(layout.dtype).removeprefix("torch."), self.num_blocks * config.block_size)

    def cache_config(self) -> dict[str, str]:
        """vLLM's `vllm:cache_config_info` labels (the ones this engine has)."""
        return {"block_size": str(self.block_size), "cache_dtype": self._kv_cache_dtype_name,
                "num_gpu_blocks": str(self.num_blocks), "calculate_kv_scales": str(self._calculate_kv_scales)}

    def _check_kv_cache_dtype(self, name: str) -> None:
        if (name != "auto" and self.device.type == "cuda" and self.kv_cache_dtype == torch.float8_e4m3fn
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ValueError(f"--kv-cache-dtype {name} (fp8 e4m3) needs a GPU of compute capability 8.9 or "
                             "newer (Triton has no e4m3 before Ada/Hopper); use --kv-cache-dtype fp8_e5m2")

    def _kv_cache_budget(self, config: EngineConfig) -> int:
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * config.gpu_memory_utilization)
        return CPU_DEFAULT_KV_CACHE_BYTES

    def _host_step(self, out: SchedulerOutput) -> "HostStep":
        """Flatten the step into numpy arrays (once per step), with its sampling rows (sequences,
        and draft positions in a speculative step) and, for each, its row among the computed
        logits (n>1 siblings share a row)."""
        items = out.scheduled
        query_lens = [item.num_new_tokens for item in items]
        starts = [item.seq.num_computed_tokens for item in items]
        input_ids: list[int] = []
        for item, start, count in zip(items, starts, query_lens):
            input_ids += item.seq.token_ids[start:start + count]
            if item.num_drafts:
                input_ids += item.seq.draft_token_ids[:item.num_drafts]
        tables = [item.seq.block_table for item in items]
        width = max(len(table) for table in tables)
        block_tables = np.array([table + [0] * (width - len(table)) for table in tables],
                                dtype=np.int32)
        query_start = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        seq_lens = np.add(starts, query_lens)
        seq_index = np.repeat(np.arange(len(items)), query_lens)
        positions = np.arange(query_start[-1]) - query_start[seq_index] + np.asarray(starts)[seq_index]
        slots = (block_tables[seq_index, positions // self.block_size].astype(np.int64)
                 * self.block_size + positions % self.block_size)
        sampling = [i for i, item in enumerate(items) if item.samples]
        if out.num_drafts:
            seqs, logits_indices = self._verify_rows(items, sampling, query_start)
        else:
            seqs, logits_indices = [items[i].seq for i in sampling], query_start[1:][sampling] - 1
        row_of: dict[int, int] = {}   # a fork samples from its parent's row (a prompt's last)
        for i in sampling if out.forks else ():
            row_of[i] = len(row_of) + sum(items[j].num_drafts for j in row_of)
        seqs += [sibling for sibling, _ in out.forks]
        rows = list(range(len(logits_indices))) + [row_of[parent] for _, parent in out.forks]
        return HostStep(np.asarray(input_ids, dtype=np.int64), positions, slots, block_tables, query_start,
                        seq_lens, np.asarray(logits_indices, dtype=np.int64), query_lens, seqs, rows)

    def prepare(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[SamplingRow], list[int]]:
        """The step as a ForwardBatch on the device, its sampling rows and their logits rows."""
        host = self._host_step(out)
        return self._device_batch(out, host), host.seqs, host.rows

    def _device_batch(self, out: SchedulerOutput, host: "HostStep") -> ForwardBatch:
        adapter_slots = self.adapters.token_slots(out.scheduled, host.query_lens) if self.adapters is not None else None
        return ForwardBatch(
            input_ids=self._tensor(host.input_ids),
            positions=self._tensor(host.positions),
            slot_mapping=self._tensor(host.slots),
            block_tables=self._tensor(host.block_tables),
            query_start_loc=self._tensor(host.query_start.astype(np.int32)),
            seq_lens=self._tensor(host.seq_lens.astype(np.int32)),
            logits_indices=self._tensor(host.logits_indices),
            max_query_len=max(host.query_lens),
            max_seq_len=int(host.seq_lens.max()),
            query_lens_cpu=host.query_lens,
            seq_lens_cpu=host.seq_lens.tolist(),
            adapter_indices=self._tensor(adapter_slots) if adapter_slots is not None else None,
        )

    @staticmethod
    def _verify_rows(items: list[ScheduledSeq], sampling: list[int], query_start: np.ndarray
                     ) -> tuple[list[SamplingRow], np.ndarray]:
        """A speculative step's sampling rows: a sequence with k drafts is scored at its last
        known token and after each draft (k + 1 rows, `DraftPosition`s after the first)."""
        seqs: list[SamplingRow] = []
        indices: list[int] = []
        for i in sampling:
            item, end = items[i], int(query_start[i + 1])
            seqs += [item.seq] + [DraftPosition(item.seq, k) for k in range(1, item.num_drafts + 1)]
            indices += range(end - 1 - item.num_drafts, end)
        return seqs, np.asarray(indices, dtype=np.int64)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run_hidden(self, out: SchedulerOutput, rows: np.ndarray) -> torch.Tensor:
        """One forward pass returning the final hidden states of flat-batch rows `rows` instead
        of logits (an embedding model's step, `pooler.py`)."""
        batch, _, _ = self.prepare(out)
        batch.logits_indices = self._tensor(rows)
        return self.model.hidden_states(batch, self.kv_caches)

    def capture_decode_graphs(self, config: EngineConfig, max_model_len: int) -> None:
        """Capture the decode step in CUDA graphs (`cuda_graphs.py`), or on the CPU record its kernel
        calls at each size's first step (`cpu_graphs.py`), where the model allows it. A forward
        pass that cannot be captured (it waits on the GPU, as quantized MoE experts do to group
        tokens by expert) raises at capture: decode then stays eager."""
        options = dict(device=self.device, enforce_eager=config.enforce_eager, enable_lora=config.enable_lora,
                       calculate_kv_scales=config.calculate_kv_scales,
                       tensor_parallel_size=config.world_size)
        if self.device.type == "cpu":
            reason = why_not_cpu_graphed(self.model, **options)
            if reason is None:
                self.graphs = CpuDecodeGraphs(self.model, self.kv_caches, max_num_seqs=config.max_num_seqs,
                                              max_model_len=max_model_len, block_size=self.block_size,
                                              num_blocks=self.num_blocks)
                return
            log.info("decode steps run eagerly (no recorded kernel calls): %s", reason)
        reason = why_not_graphed(self.model, **options)
        if reason is not None:
            if self.device.type == "cuda":
                log.info("decode steps run eagerly (no CUDA graphs): %s", reason)
            return
        graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs=config.max_num_seqs,
                              max_model_len=max_model_len, block_size=self.block_size,
                              num_blocks=self.num_blocks, device=self.device)
        try:
            graphs.capture()
        except Exception as error:  # noqa: BLE001 - e.g. a layer that reads a device value on the host
            log.warning("decode steps run eagerly: capturing them in CUDA graphs failed: %s", error)
            return
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[SamplingRow]]:
        """One forward pass; float32 logits, one row per sampling row (a sampling sequence, and
        each of its draft positions in a speculative step; None if none sample)."""
        logits = None
        if self.prompt_logprobs is not None and self.prompt_logprobs.owed(out):
            return self._run_with_prompt_logprobs(out)
        if (self.graphs is not None and not out.num_drafts and self.graphs.fits(
                [item.num_new_tokens for item in out.scheduled],
                max(len(item.seq.block_table) for item in out.scheduled))):
            host = self._host_step(out)
            logits = self.graphs.replay(host.input_ids, host.positions, host.slots, host.block_tables,
                                        host.seq_lens)
            if logits is not None and len(host.logits_indices) != len(out.scheduled):   # one does not sample
                logits = logits.index_select(0, self._tensor(host.logits_indices))
            seqs, rows = host.seqs, host.rows
        if logits is None:   # not a graphed step, or a CPU size just refused
            batch, seqs, rows = self.prepare(out)
            logits = self.model(batch, self.kv_caches)
        return self._sampling_logits(logits, seqs, rows)

    @staticmethod
    def _sampling_logits(logits: torch.Tensor, seqs: list[SamplingRow], rows: list[int]
                         ) -> tuple[torch.Tensor | None, list[SamplingRow]]:
        if not seqs:
            return None, seqs
        if rows != list(range(len(rows))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        return logits, seqs

    def _run_with_prompt_logprobs(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[SamplingRow]]:
        """An eager step whose model call also computes the logits of the prompt positions
        `PromptLogprobs.plan` names (after the sampling rows), scored there."""
        assert self.prompt_logprobs is not None
        host = self._host_step(out)
        batch = self._device_batch(out, host)
        plan: PromptLogprobPlan | None = self.prompt_logprobs.plan(out, host.query_start)
        num_sampling = len(host.logits_indices)
        if plan is not None:
            batch.logits_indices = torch.cat([batch.logits_indices, self._tensor(plan.rows)])
        logits = self.model(batch, self.kv_caches)
        if plan is not None:
            self.prompt_logprobs.accept(logits[num_sampling:], plan)
        return self._sampling_logits(logits[:num_sampling], host.seqs, host.rows)


def kv_cache_layout(loaded: "LoadedModel", config: EngineConfig) -> KVCacheLayout:
    """Rank 0's cache (or the one device's): its share of the KV heads of its stage's layers."""
    mc = loaded.config
    return KVCacheLayout(loaded.kv_cache_layers or mc.num_hidden_layers, config.block_size,
                         kv_heads_per_rank(mc, config.tensor_parallel_size), mc.head_dim,
                         kv_cache_torch_dtype(config.kv_cache_dtype, loaded.dtype))


@dataclass
class HostStep:
    """A step flattened on the host: what `prepare` moves to the device, or a graph replay copies
    into its static buffers."""

    input_ids: np.ndarray      # [T] int64
    positions: np.ndarray      # [T] int64
    slots: np.ndarray          # [T] int64
    block_tables: np.ndarray   # [S, width] int32
    query_start: np.ndarray    # [S + 1] int64
    seq_lens: np.ndarray       # [S] int64
    logits_indices: np.ndarray  # [L] int64
    query_lens: list[int]
    seqs: list[SamplingRow]
    rows: list[int]
