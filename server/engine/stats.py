"""A snapshot of the engine's counters, read by /metrics and the autoscaler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DecayingSum:
    """A sum whose terms halve every `half_life` seconds: how much *recent* work a quantity did
    (an engine pod's deletion cost is its prefix-cache hits of the last minutes, not since
    start). Terms are credited at the end of the wall-clock `tick` they arrived in, and `value`
    is the sum as of the current tick's start, so every reader within one tick (the operator,
    Prometheus) reads the same number and an idle engine's value still decays.
    Immutable: the engine thread replaces it, snapshots share it."""

    half_life: float = 600.0
    tick: float = 15.0
    index: int = 0   # the tick `settled` is as of the start of
    settled: float = 0.0   # terms before tick `index`, decayed to its start
    pending: float = 0.0   # terms within tick `index`

    def _rolled(self, index: int) -> float:
        if index <= self.index:
            return self.settled
        ticks = index - self.index   # pending arrived in tick self.index: settled at its end
        return (self.settled * 0.5 ** (ticks * self.tick / self.half_life)
                + self.pending * 0.5 ** ((ticks - 1) * self.tick / self.half_life))

    def add(self, amount: float, now: float) -> "DecayingSum":
        index = math.floor(now / self.tick)
        if index <= self.index:
            return DecayingSum(self.half_life, self.tick, self.index, self.settled, self.pending + amount)
        return DecayingSum(self.half_life, self.tick, index, self._rolled(index), amount)

    def value(self, now: float) -> float:
        return self._rolled(math.floor(now / self.tick))


@dataclass
class SpecDecodeStats:
    """Cumulative counters under vLLM's names (vllm:spec_decode_*)."""

    num_drafts: int = 0          # sequence-steps that scored at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts accepted at position i

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # blocks in use by requests / total
    num_blocks_total: int = 0
    num_blocks_free: int = 0  # on the free list: excludes the evictable ones below
    num_blocks_evictable: int = 0  # hold only a cached prefix: reclaimed when blocks run out
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    recent_prefix_cache_hits: DecayingSum = field(default_factory=DecayingSum)  # tokens, decaying
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative
    generation_tokens: int = 0  # cumulative
    num_steps: int = 0
    last_step_seconds: float = 0.0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_time: float = 0.0  # time.monotonic() when the loop last finished a step
    max_lora: int = 0  # LoRA device slots; 0 = --enable-lora off
    running_lora_adapters: tuple[str, ...] = ()  # adapters of running requests
    waiting_lora_adapters: tuple[str, ...] = ()  # adapters of waiting requests
    spec_decode: SpecDecodeStats | None = None  # None: no speculative decoding
