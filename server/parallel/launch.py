"""Starting the ranks: node 0's side (rank 0 in the engine's process plus its local workers) and a
headless node's side (`kubeinfer serve --headless`: its local workers only), and watching them.

A rank that dies takes the whole server down (log line, exit code 1) so Kubernetes restarts
the pod (LeaderWorkerSet: the group): without its shard no step can run, and a half-alive
server only times out requests. Local ranks are watched through their process sentinels,
other nodes through one liveness connection each (`liveness.py`).
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.connection
import os
import socket
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
from . import liveness
from .group import IDLE_TIMEOUT, Topology, agree_on_load, free_port, host_store, init_group
from .model import load_shard
from .plan import ShardPlan
from .step_broadcast import send_stop
from .worker import WorkerSpec, run_worker

log = logging.getLogger(__name__)

Process = multiprocessing.process.BaseProcess
# The engine flags every node must share: they decide what each rank loads and how it lays out the KV cache.
SHARED_FLAGS = ("model", "dtype", "device", "quantization", "block_size", "kv_cache_dtype", "calculate_kv_scales",
                "enable_lora", "max_loras", "max_lora_rank", "tensor_parallel_size", "pipeline_parallel_size",
                "nnodes", "master_port")
SETTINGS_KEY = "kubeinfer/settings"


def _shared_settings(config: EngineConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in SHARED_FLAGS}


def _check_same_settings(config: EngineConfig, store: dist.TCPStore) -> None:
    """A headless node refuses to start ranks that would not match node 0's (e.g. another
    --block-size would read its KV cache in another layout): every node needs the same flags."""
    leader = json.loads(store.get(SETTINGS_KEY))
    ours = json.loads(json.dumps(_shared_settings(config)))
    differ = [f"--{name.replace('_', '-')} (node 0: {leader[name]!r}, node {config.node_rank}: {ours[name]!r})"
              for name in SHARED_FLAGS if leader.get(name) != ours[name]]
    if differ:
        raise ValueError(f"node {config.node_rank} was started with other engine flags than node 0: "
                         f"{', '.join(differ)}; start every node with the same flags")


class WorkerGroup:
    """The spawned workers of this process and the liveness connections of the other nodes
    (one group per process: torch.distributed's default group)."""

    def __init__(self, processes: list[Process], device: torch.device, listener: socket.socket | None = None,
                 nodes: int = 1) -> None:
        self.processes, self.device, self.listener = processes, device, listener
        self.waiting_for = nodes - 1   # headless nodes yet to connect
        self.closing = False
        self.threads = torch.get_num_threads()
        threading.Thread(target=self._watch, name="kubeinfer-parallel-monitor", daemon=True).start()

    def _watch(self) -> None:
        watched: list = [p.sentinel for p in self.processes] + ([self.listener] if self.listener else [])
        nodes: dict[socket.socket, int] = {}
        while True:
            ready = multiprocessing.connection.wait(watched)
            if self.closing:
                return
            for item in ready:
                if item is self.listener:
                    connection, _ = self.listener.accept()
                    node = liveness.read_node_rank(connection)
                    if node is not None:
                        nodes[connection] = node
                        watched.append(connection)
                        log.info("node %d connected", node)
                        self.waiting_for -= 1
                    if self.waiting_for == 0:
                        watched.remove(self.listener)
                    continue
                if item in nodes:
                    log.critical("node %d disconnected (its pod or a rank on it died); the engine cannot run "
                                 "without its ranks: exiting", nodes[item])
                else:
                    dead = next(p for p in self.processes if p.sentinel == item)
                    log.critical("parallel worker %s (pid %s) died with exit code %s; the engine cannot run "
                                 "without its shard: exiting", dead.name, dead.pid, dead.exitcode)
                self._kill_local()
                os._exit(1)

    def _kill_local(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()

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


def topology_of(config: EngineConfig) -> Topology:
    """Within one node the rendezvous is on loopback at a free port; across nodes at the master's."""
    if config.nnodes == 1:
        return Topology(config.tensor_parallel_size, config.pipeline_parallel_size, 1, "127.0.0.1", free_port())
    return Topology(config.tensor_parallel_size, config.pipeline_parallel_size, config.nnodes, config.master_addr,
                    config.master_port)


def _worker_processes(config: EngineConfig, topology: Topology, ranks: range) -> list[Process]:
    """Spawned (not started) workers for `ranks`, after checking the model can be split so."""
    device = resolve_device(config.device)
    checkpoint = read_checkpoint(config.model)
    ShardPlan(checkpoint.config, 0, topology.tensor, 0, topology.pipeline)   # refuses a bad split before spawning
    source = embedded_model_path() if config.model == "embedded" else Path(config.model).expanduser()
    architecture = checkpoint.config.architecture
    family = model_family(architecture)
    context = torch.multiprocessing.get_context("spawn")
    return [context.Process(target=run_worker, name=f"rank{rank}", daemon=True, args=(WorkerSpec(
        config, str(source), architecture, family, resolve_dtype(config.dtype, device), device.type, rank, topology,
        logging.getLogger().level),))
        for rank in ranks]


def load_tensor_parallel(config: EngineConfig) -> LoadedModel:
    """Rank 0's LoadedModel: the full config and tokenizer, a model that drives the other ranks
    (its local workers, spawned here, and those of the headless nodes)."""
    global _active
    if _active is not None:
        raise RuntimeError("a parallel engine is already running in this process")
    if config.node_rank != 0:
        raise ValueError(f"--node-rank {config.node_rank} serves no API: start it with --headless")
    start = time.perf_counter()
    topology = topology_of(config)
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
    plan = ShardPlan(checkpoint.config, 0, topology.tensor, 0, topology.pipeline)   # validates the split first
    family = model_family(checkpoint.config.architecture)
    source = embedded_model_path() if config.model == "embedded" else Path(config.model).expanduser()
    processes = _worker_processes(config, topology, topology.node_ranks(0)[1:])
    for process in processes:
        process.start()
    store = host_store(topology)
    listener = None
    if topology.nnodes > 1:
        store.set(SETTINGS_KEY, json.dumps(_shared_settings(config)))
        listener = liveness.listen(store)
    _active = WorkerGroup(processes, device, listener, topology.nnodes)
    atexit.register(shutdown_tensor_parallel)
    if topology.nnodes > 1:
        log.info("waiting for %d ranks on %d other nodes at %s:%d", topology.world - len(processes) - 1,
                 topology.nnodes - 1, topology.master_addr, topology.master_port)
    device, _ = init_group(0, topology, device, store)
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
        raise ValueError(f"parallel rank {rank}: {message}")
    log.info("tensor parallel %d x pipeline parallel %d over %d node(s): rank 0 holds %d of %d heads, %d of %d KV "
             "heads, layers %d-%d; all ranks loaded in %.2fs%s", topology.tensor, topology.pipeline, topology.nnodes,
             plan.num_heads, checkpoint.config.num_attention_heads, plan.num_kv_heads,
             checkpoint.config.num_key_value_heads, plan.layers.start, plan.layers.stop - 1,
             time.perf_counter() - start, "" if method is None else f"; linear layers quantized with {method.name}")
    checkpoint.config.eos_token_ids = checkpoint.tokenizer.eos_token_ids
    return LoadedModel(model=model, config=checkpoint.config, tokenizer=checkpoint.tokenizer,
                       generation_defaults=checkpoint.generation_defaults, name=checkpoint.name, dtype=dtype,
                       device=device, kv_scales=model.kv_scales, kv_cache_layers=len(plan.layers))


def run_headless(config: EngineConfig) -> int:
    """`kubeinfer serve --headless`: start this node's ranks and wait; 0 when node 0 stopped them,
    1 as soon as one of them dies or node 0 goes away (the group must then be recreated)."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError("--headless runs a node other than node 0: it needs --nnodes > 1 and --node-rank > 0")
    topology = topology_of(config)
    ranks = topology.node_ranks(config.node_rank)
    log.info("node %d of %d: ranks %d-%d; waiting for node 0 at %s:%d", config.node_rank, topology.nnodes,
             ranks.start, ranks.stop - 1, topology.master_addr, topology.master_port)
    store = dist.TCPStore(topology.master_addr, topology.master_port, is_master=False, timeout=IDLE_TIMEOUT)
    _check_same_settings(config, store)
    processes = _worker_processes(config, topology, ranks)
    for process in processes:
        process.start()
    connection = liveness.connect(topology.master_addr, store, config.node_rank)
    sentinels = {p.sentinel: p for p in processes}
    multiprocessing.connection.wait([*sentinels, connection])
    for process in processes:   # node 0 stopped them (a clean exit) or is gone: give them a moment
        process.join(timeout=5)
    failed = [p for p in processes if p.exitcode != 0]
    for process in failed:
        log.critical("rank %s (pid %s) exited with %s; this node's group must be recreated", process.name,
                     process.pid, "no exit code (killed)" if process.exitcode is None else process.exitcode)
        if process.is_alive():
            process.kill()
    connection.close()
    return 1 if failed else 0
