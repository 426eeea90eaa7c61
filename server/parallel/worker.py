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

from ..model.adapters.lora import read_peft_adapter
from ..model.adapters.lora_layers import LoRAModel
from ..model.forward_batch import ForwardBatch
from ..model.layers.kv_cache_quant import LayerKVCache, kv_cache_torch_dtype, layer_kv_scales
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
    """Everything a spawned worker needs (pickled once, at spawn)."""

    source: str
    architecture: str
    family: ModelFamily   # rank 0's registry entry: a family registered at run time reaches the workers
    dtype: torch.dtype
    device: str
    rank: int                 # in the whole group
    topology: Topology
    block_size: int
    log_level: int
    max_loras: int = 0        # LoRA device slots (--enable-lora); 0 = none
    max_lora_rank: int = 0
    kv_cache_dtype: str = "auto"   # rank 0's --kv-cache-dtype and --calculate-kv-scales
    calculate_kv_scales: bool = False
    quantization: str = "auto"     # rank 0's --quantization


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
                           resolve_for_checkpoint(checkpoint, spec.quantization))
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
    lora = _lora_slots(model, plan, spec, device) if spec.max_loras else None
    with torch.inference_mode():
        serve_steps(model, spec, device, lora)
    dist.destroy_process_group()


def _lora_slots(model: TensorParallelModel, plan: ShardPlan, spec: WorkerSpec, device: torch.device) -> LoRAModel:
    """This rank's LoRA slots, its A/B slices following its weights'."""
    return LoRAModel(model.shard, spec.max_loras, spec.max_lora_rank, spec.dtype, device,
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
            lora.write(slot, None if path is None else read_peft_adapter(f"slot {slot}", path, spec.max_lora_rank,
                                                                         spec.dtype))
            continue
        batch, num_blocks = step
        if kv_caches is None:
            kv_caches = _allocate_kv_caches(model, num_blocks, spec, device)
        model.compute(batch, kv_caches)


def _allocate_kv_caches(model: TensorParallelModel, num_blocks: int, spec: WorkerSpec,
                        device: torch.device) -> KVCaches:
    """This rank's share of the heads of its stage's layers, in rank 0's cache dtype (an fp8 cache with its own scales:
    the checkpoint's, or calculated from this rank's heads)."""
    config = model.plan.config
    shape = (num_blocks, spec.block_size, model.plan.num_kv_heads, config.head_dim)
    dtype = kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
    scales = layer_kv_scales(len(model.plan.layers), dtype, model.kv_scales, spec.calculate_kv_scales)
    return [LayerKVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                         layer_scales) for layer_scales in scales]


def _exit_with_parent(parent: int) -> None:
    """A worker never outlives rank 0 (e.g. SIGKILLed): it notices being re-parented within a second."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kubeinfer-tp-parent-watch", daemon=True).start()
