"""The engine's side of multi-LoRA: slots for waiting requests, each token's slot, and the
requests whose adapter failed this step. Everything here runs on the engine thread, except
`read` (file I/O, on the server's threads) and the registry queries.

A request names its adapter (`Request.adapter`, also its prefix-cache namespace). The
scheduler, built with `admit` as its admission check, asks it before starting a waiting
sequence: the adapter gets a device slot (`LoRAManager.activate`) or the sequence waits while
others are scheduled. The model runner, built with these adapters, asks `token_slots` for
`ForwardBatch.adapter_indices` (None when no token uses an adapter). What depends on the
queues (which adapters are in use) reads the scheduler it is given.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..flags import LoRAModuleSpec
from ..model.adapters.lora import LoRAError, LoRAWeights
from ..model.adapters.lora_layers import LoRAModel
from ..model.adapters.lora_manager import LoRAManager
from .config import EngineConfig

if TYPE_CHECKING:
    from .scheduler import ScheduledSeq, Scheduler
    from .sequence import Request, Sequence

log = logging.getLogger(__name__)


class EngineAdapters:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`model`: the loaded model, or rank 0's `TensorParallelModel` (whose workers fill
        their slots from the same adapter directory when rank 0 fills one)."""
        from ..parallel.model import TensorParallelModel, weight_slices

        write = None
        if isinstance(model, TensorParallelModel):
            from ..parallel.step_broadcast import send_lora_slot

            shard = model.shard
            self.lora_model = LoRAModel(shard, config.max_loras, config.max_lora_rank, dtype, device,
                                        slices=weight_slices(shard, model.plan))

            def write(slot: int, weights: LoRAWeights | None) -> None:
                send_lora_slot(slot, weights.path if weights is not None else None, device)
                self.lora_model.write(slot, weights)
        else:
            self.lora_model = LoRAModel(model, config.max_loras, config.max_lora_rank, dtype, device)
        self.manager = LoRAManager(write or self.lora_model.write, self.lora_model.check, config.max_loras,
                                   config.max_cpu_loras or config.max_loras, config.max_lora_rank, dtype)
        self.max_loras = config.max_loras
        self.failures: list[tuple["Request", Exception]] = []   # found while scheduling; failed by the engine
        for module in config.lora_modules or ():
            try:
                weights = self.manager.read(module)
            except (LoRAError, OSError) as error:
                raise ValueError(f"--lora-modules {module}: {error}") from error
            self.manager.register(module, weights, set())

    # -- the registry (any thread) --------------------------------------------------------------

    def known(self, name: str) -> bool:
        return self.manager.known(name)

    def modules(self) -> list[LoRAModuleSpec]:
        return self.manager.modules()

    def read(self, module: LoRAModuleSpec) -> LoRAWeights:
        return self.manager.read(module)

    # -- the engine thread ----------------------------------------------------------------------

    @staticmethod
    def in_use(scheduler: "Scheduler") -> tuple[set[str], set[str]]:
        """Adapters of running sequences, and of running or waiting ones."""
        running = {s.request.adapter for s in scheduler.running if s.request.adapter is not None}
        waiting = {s.request.adapter for s in scheduler.waiting if s.request.adapter is not None}
        return running, running | waiting

    def register(self, module: LoRAModuleSpec, weights: LoRAWeights, scheduler: "Scheduler") -> None:
        """Load `module`; the prefix cache forgets what an earlier adapter of the same name left
        (none of its requests remain: `LoRAManager.register` refuses while any does)."""
        self.manager.register(module, weights, self.in_use(scheduler)[1])
        if scheduler.kv.cache is not None:
            scheduler.kv.cache.drop_adapter(module.name)

    def unregister(self, name: str, scheduler: "Scheduler") -> None:
        self.manager.unregister(name, self.in_use(scheduler)[1])

    def admit(self, seq: "Sequence", scheduler: "Scheduler") -> bool:
        """Whether `seq` may start now: its adapter (if any) has, or just got, a device slot."""
        name = seq.request.adapter
        if name is None or self.manager.touch(name):
            return True
        running, in_use = self.in_use(scheduler)
        self.manager.release_unused(in_use)
        try:
            return self.manager.activate(name, running, in_use)
        except (LoRAError, OSError) as error:
            if not any(request is seq.request for request, _ in self.failures):
                self.failures.append((seq.request, error))
            return False

    def token_slots(self, items: list["ScheduledSeq"], query_lens: list[int]) -> np.ndarray | None:
        """[T] int32 slot of each token of the step (-1: the base model), None when all are -1."""
        slots = [self.manager.slot_of(item.seq.request.adapter) if item.seq.request.adapter is not None else -1
                 for item in items]
        if max(slots, default=-1) < 0:
            return None
        return np.repeat(np.asarray(slots, dtype=np.int32), query_lens)

    def failed_requests(self, items: list["ScheduledSeq"]) -> list[tuple["Request", Exception]]:
        """The requests of this step whose adapter's delta raised (their tokens are wrong)."""
        failed = self.lora_model.batch.failed
        if not failed:
            return []
        names = {name: error for name in self.manager.resident()
                 if (error := failed.get(self.manager.slot_of(name))) is not None}
        return [(item.seq.request, names[item.seq.request.adapter]) for item in items
                if item.seq.request.adapter in names]

    @staticmethod
    def running_and_waiting(scheduler: "Scheduler") -> tuple[list[str], list[str]]:
        """For vllm:lora_requests_info: adapters with running requests, and with waiting ones."""
        running = sorted({s.request.adapter for s in scheduler.running if s.request.adapter is not None})
        waiting = sorted({s.request.adapter for s in scheduler.waiting if s.request.adapter is not None})
        return running, waiting
