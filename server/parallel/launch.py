"""Rank 0's side of tensor parallelism: validate, spawn the workers, load its own shard, watch them.

A worker that dies takes the whole server down (log line, exit code 1) so Kubernetes restarts
the pod: without its shard no step can run, and a half-alive server only times out requests.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

from ..engine.config import EngineConfig
from ..model.loader import LoadedModel, embedded_model_path, read_checkpoint, resolve_device, resolve_dtype
from ..model.quantization import resolve_for_checkpoint
from ..model.registry import model_family
from .group import agree_on_load, free_port, init_group
from .model import load_shard
from .plan import ShardPlan
from .step_broadcast import send_stop
from .worker import WorkerSpec, run_worker

log = logging.getLogger(__name__)


class WorkerGroup:
    """The spawned workers of this process (one group per process: torch.distributed's default group)."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess], device: torch.device) -> None:
        self.processes, self.device = processes, device
        self.closing = False
        self.threads = torch.get_num_threads()
        threading.Thread(target=self._watch, name="kubeinfer-tp-monitor", daemon=True).start()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.processes])
        if self.closing:
            return
        dead = next(p for p in self.processes if p.sentinel in ready)
        log.critical("tensor-parallel worker %s (pid %s) died with exit code %s; the engine cannot run without "
                     "its shard: exiting", dead.name, dead.pid, dead.exitcode)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        os._exit(1)

    def close(self) -> None:
        """Stop the workers (rank 0 must not be inside a step) and leave the process group."""
        if self.closing:
            return
        self.closing = True
        joined = dist.is_initialized()   # False when rank 0 failed before joining the group
        if joined:
            try:
                send_stop(self.device)
            except RuntimeError:   # a worker already gone: nothing to tell it
                pass
        for process in self.processes:
            process.join(timeout=10 if joined else 0)
            if process.is_alive():
                process.kill()
        if joined:
            dist.destroy_process_group()
        torch.set_num_threads(self.threads)


_active: WorkerGroup | None = None


def shutdown_tensor_parallel() -> None:
    """Stop this process's workers, if any (also runs at exit)."""
    global _active
    if _active is not None:
        _active.close()
        _active = None


def load_tensor_parallel(config: EngineConfig) -> LoadedModel:
    """Rank 0's LoadedModel: the full config and tokenizer, a model that drives N-1 spawned workers."""
    global _active
    if _active is not None:
        raise RuntimeError("a tensor-parallel engine is already running in this process")
    start = time.perf_counter()
    size = config.tensor_parallel_size
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    checkpoint = read_checkpoint(config.model)
    method = resolve_for_checkpoint(checkpoint, config.quantization)   # refuses a bad format before spawning
    if method is not None and checkpoint.gguf:
        # NOTE: a rank un-permutes llama.cpp's q/k rows for its own heads only, so it cannot read
        # them whole to quantize per channel before its cut
        raise ValueError(f"--quantization {config.quantization} re-quantizes a GGUF file's weights at load, which "
                         "is not supported with tensor parallelism yet; use --quantization auto or "
                         "--tensor-parallel-size 1")
    plan = ShardPlan(checkpoint.config, 0, size)   # validates the split before anything starts
    architecture = checkpoint.config.architecture
    family = model_family(architecture)
    source = embedded_model_path() if config.model == "embedded" else Path(config.model).expanduser()
    port = free_port()
    context = torch.multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_worker, name=f"tp-rank{rank}", daemon=True, args=(WorkerSpec(
        str(source), architecture, family, dtype, device.type, rank, size, port, config.block_size,
        logging.getLogger().level, config.max_loras if config.enable_lora else 0, config.max_lora_rank,
        config.kv_cache_dtype, config.calculate_kv_scales, config.quantization),))
        for rank in range(1, size)]
    for process in processes:
        process.start()
    _active = WorkerGroup(processes, device)
    atexit.register(shutdown_tensor_parallel)
    device = init_group(0, size, port, device)
    try:
        model = load_shard(source, family, plan, dtype, device, method)
        error = None
    except ValueError as failure:
        error = failure
    errors = agree_on_load(error)
    if error is not None or any(errors):
        shutdown_tensor_parallel()
        if error is not None:
            raise error
        rank, message = next((rank, message) for rank, message in enumerate(errors) if message)
        raise ValueError(f"tensor-parallel rank {rank}: {message}")
    log.info("tensor parallel %d: rank 0 holds %d of %d heads, %d of %d KV heads; loaded in %.2fs%s", size,
             plan.num_heads, checkpoint.config.num_attention_heads, plan.num_kv_heads,
             checkpoint.config.num_key_value_heads, time.perf_counter() - start,
             "" if method is None else f"; linear layers quantized with {method.name}")
    checkpoint.config.eos_token_ids = checkpoint.tokenizer.eos_token_ids
    return LoadedModel(model=model, config=checkpoint.config, tokenizer=checkpoint.tokenizer,
                       generation_defaults=checkpoint.generation_defaults, name=checkpoint.name, dtype=dtype,
                       device=device, kv_scales=model.kv_scales)
