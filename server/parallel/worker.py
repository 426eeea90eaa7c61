"""A worker process (every rank but 0, on any node): load its shard, then run every step rank 0 sends."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine.config import EngineConfig
from ..engine.kv_cache_layout import KVCacheLayout
from ..model.adapters.lora import read_peft_adapter
from ..model.adapters.lora_layers import LoRAModel
from ..model.forward_batch import ForwardBatch
from ..model.layers.kv_cache_quant import kv_cache_torch_dtype
from ..model.loader import read_checkpoint
from ..model.quantization import resolve_for_checkpoint
from ..model.registry import ModelFamily, register_model
from .group import Topology, agree_on_load, init_group
from .model import KVCaches, TensorParallelModel, load_shard, weight_slices
from .plan import ShardPlan
from .step_broadcast import receive_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned worker needs (pickled once, at spawn): the engine's flags (the ones
    that decide what a rank loads and how it lays out its KV cache: block size, KV-cache dtype and
    scales, quantization, LoRA slots; `launch.SHARED_FLAGS`) and what its node resolved of them."""

    config: EngineConfig
    source: str               # the checkpoint's path (`config.model` resolved)
    architecture: str
    family: ModelFamily   # rank 0's registry entry: a family registered at run time reaches the workers
    dtype: torch.dtype        # `config.dtype` and `config.device` resolved on this node
    device: str
    rank: int                 # in the whole group
    topology: Topology
    log_level: int


def run_worker(spec: WorkerSpec) -> None:
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank} %(name)s: "
                                                     "%(message)s")
    # Ctrl-C reaches the whole process group: rank 0 drains and then stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(os.getppid())
    device, _ = init_group(spec.rank, spec.topology, torch.device(spec.device))
    start = time.perf_counter()
    register_model(spec.architecture, spec.family)
    checkpoint = read_checkpoint(spec.source)
    tensor = spec.topology.tensor
    plan = ShardPlan(checkpoint.config, spec.rank % tensor, tensor, spec.rank // tensor, spec.topology.pipeline)
    try:
        model = load_shard(Path(spec.source), spec.family, plan, spec.dtype, device,
                           resolve_for_checkpoint(checkpoint, spec.config.quantization))
        error = None
    except ValueError as failure:   # a checkpoint this rank cannot hold: rank 0 reports it and stops us
        error = failure
    if any(agree_on_load(error)):
        while receive_step(device) is not None:
            pass
        dist.destroy_process_group()
        return
    log.info("rank %d/%d: shard of %d heads, %d KV heads, layers %d-%d loaded in %.2fs", spec.rank,
             spec.topology.world, plan.num_heads, plan.num_kv_heads, plan.layers.start, plan.layers.stop - 1,
             time.perf_counter() - start)
    lora = _lora_slots(model, plan, spec, device) if spec.config.enable_lora else None
    with torch.inference_mode():
        serve_steps(model, spec, device, lora)
    dist.destroy_process_group()


def _lora_slots(model: TensorParallelModel, plan: ShardPlan, spec: WorkerSpec, device: torch.device) -> LoRAModel:
    """This rank's LoRA slots, its A/B slices following its weights'."""
    return LoRAModel(model.shard, spec.config.max_loras, spec.config.max_lora_rank, spec.dtype, device,
                     slices=weight_slices(model.shard, plan))


def serve_steps(model: TensorParallelModel, spec: WorkerSpec, device: torch.device,
                lora: LoRAModel | None = None) -> None:
    """Follow rank 0 step by step; the KV cache is sized by rank 0 and allocated on the first step.
    LoRA slot commands come between steps: the adapter is read here from the same path."""
    kv_caches: KVCaches | None = None
    while (step := receive_step(device)) is not None:
        if not isinstance(step[0], ForwardBatch):
            slot, path = step
            assert lora is not None and isinstance(slot, int)
            lora.write(slot, None if path is None else read_peft_adapter(f"slot {slot}", path,
                                                                         spec.config.max_lora_rank, spec.dtype))
            continue
        batch, num_blocks = step
        if kv_caches is None:
            kv_caches = _allocate_kv_caches(model, num_blocks, spec, device)
        model.compute(batch, kv_caches)


def _allocate_kv_caches(model: TensorParallelModel, num_blocks: int, spec: WorkerSpec,
                        device: torch.device) -> KVCaches:
    """This rank's share of the heads of its stage's layers, in rank 0's cache dtype (an fp8 cache with its own scales:
    the checkpoint's, or calculated from this rank's heads)."""
    plan, config = model.plan, spec.config
    layout = KVCacheLayout(len(plan.layers), config.block_size, plan.num_kv_heads, plan.config.head_dim,
                           kv_cache_torch_dtype(config.kv_cache_dtype, spec.dtype))
    return layout.allocate(num_blocks, device, model.kv_scales, config.calculate_kv_scales)


def _exit_with_parent(parent: int) -> None:
    """A worker never outlives rank 0 (e.g. SIGKILLed): it notices being re-parented within a second."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kubeinfer-tp-parent-watch", daemon=True).start()
