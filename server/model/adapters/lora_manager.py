"""Which adapters the engine knows, which it holds in host memory, and which sit in device slots.

Three tiers, as in vLLM: the registry (name -> path: `--lora-modules` and
`/v1/load_lora_adapter`), a host-memory LRU of read adapters (`--max-cpu-loras`, re-read from
disk on a miss) and the `--max-loras` device slots, filled at scheduling time. A waiting
request whose adapter has no slot takes the least recently used slot that no running
request's adapter holds; when every slot is held it waits (the scheduler skips it and
schedules others), as vLLM's scheduler does.

Loading reads and checks the files off the engine thread (`read`); registering, unloading
and slot changes run on the engine thread between steps. An adapter unloaded while requests
still use it keeps its weights until they finish; new requests for it get 404 at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable

import torch

from ...flags import LoRAModuleSpec
from .lora import LoRAError, LoRAWeights, read_peft_adapter

log = logging.getLogger(__name__)

# (slot, adapter or None to clear): fills a device slot on every rank
SlotWriter = Callable[[int, LoRAWeights | None], None]


class LoRAManager:
    def __init__(self, write_slot: SlotWriter, check: Callable[[LoRAWeights], None], max_loras: int,
                 max_cpu_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.write_slot, self.check = write_slot, check
        self.max_loras, self.max_cpu_loras, self.max_rank, self.dtype = max_loras, max_cpu_loras, max_rank, dtype
        self._lock = threading.Lock()          # the registry is read by the server's threads
        self.registry: dict[str, LoRAModuleSpec] = {}
        self.loaded_at: dict[str, float] = {}
        self._cpu: OrderedDict[str, LoRAWeights] = OrderedDict()   # LRU, most recent last
        self._slots: OrderedDict[str, int] = OrderedDict()          # resident name -> slot, LRU
        self._free_slots = list(range(max_loras))
        self._retired: dict[str, LoRAWeights] = {}   # unloaded while in use: kept until unused

    # -- any thread ---------------------------------------------------------------------------

    def read(self, module: LoRAModuleSpec) -> LoRAWeights:
        """Read and check an adapter (slow: file I/O; safe off the engine thread)."""
        weights = read_peft_adapter(module.name, module.path, self.max_rank, self.dtype)
        self.check(weights)
        return weights

    def known(self, name: str) -> bool:
        with self._lock:
            return name in self.registry

    def modules(self) -> list[LoRAModuleSpec]:
        with self._lock:
            return list(self.registry.values())

    # -- the engine thread --------------------------------------------------------------------

    def register(self, module: LoRAModuleSpec, weights: LoRAWeights, in_use: set[str]) -> None:
        if module.name in self.registry:
            raise LoRAError(f"The lora adapter '{module.name}' has already been loaded.")
        self.release_unused(in_use)
        if module.name in self._retired:
            raise LoRAError(f"The lora adapter '{module.name}' was unloaded and still serves requests; "
                            "load it again once they finish.")
        with self._lock:
            self.registry[module.name] = module
            self.loaded_at[module.name] = time.time()
        self._cache(weights, in_use)
        log.info("LoRA adapter %r loaded from %s (rank %d, %d modules, %.1f MiB)", module.name, module.path,
                 weights.rank, len(weights.modules), weights.num_bytes / 2**20)

    def unregister(self, name: str, in_use: set[str]) -> None:
        """Forget `name` (KeyError if unknown); its weights stay while requests in `in_use` need them."""
        with self._lock:
            del self.registry[name]
            self.loaded_at.pop(name, None)
        weights = self._cpu.pop(name, None)
        if name in in_use and weights is not None:
            self._retired[name] = weights
        elif name in self._slots:
            self._free_slots.append(self._slots.pop(name))

    def release_unused(self, in_use: set[str]) -> None:
        """Drop retired adapters that no request needs any more."""
        for name in [name for name in self._retired if name not in in_use]:
            del self._retired[name]
            if name in self._slots:
                self._free_slots.append(self._slots.pop(name))

    def slot_of(self, name: str) -> int:
        return self._slots[name]

    def touch(self, name: str) -> bool:
        """Mark a resident adapter as just used; False when it has no slot."""
        if name in self._slots:
            self._slots.move_to_end(name)
            return True
        return False

    def activate(self, name: str, pinned: Iterable[str], in_use: set[str]) -> bool:
        """Give `name` a device slot (a no-op when it has one). False when every slot is held by
        an adapter in `pinned` (running requests'): the request waits. Raises LoRAError when the
        adapter is unknown or its files no longer read."""
        if name in self._slots:
            self._slots.move_to_end(name)
            return True
        weights = self._weights(name, in_use)
        if self._free_slots:
            slot = self._free_slots.pop(0)
        else:
            held = set(pinned)
            victim = next((other for other in self._slots if other not in held), None)
            if victim is None:
                return False
            slot = self._slots.pop(victim)
            log.debug("LoRA slot %d: %r evicted for %r", slot, victim, name)
        self.write_slot(slot, weights)
        self._slots[name] = slot
        return True

    def resident(self) -> list[str]:
        return list(self._slots)

    def _weights(self, name: str, in_use: set[str]) -> LoRAWeights:
        if name in self._retired:
            return self._retired[name]
        if name in self._cpu:
            self._cpu.move_to_end(name)
            return self._cpu[name]
        module = self.registry.get(name)
        if module is None:
            raise LoRAError(f"The model `{name}` does not exist.")
        weights = self.read(module)   # evicted from host memory earlier: read it again
        self._cache(weights, in_use)
        return weights

    def _cache(self, weights: LoRAWeights, in_use: set[str]) -> None:
        self._cpu[weights.name] = weights
        while len(self._cpu) > self.max_cpu_loras:
            victim = next((name for name in self._cpu if name not in in_use and name != weights.name), None)
            if victim is None:
                break
            del self._cpu[victim]
