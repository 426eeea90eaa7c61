"""A snapshot of the engine's counters, read by /metrics and the autoscaler."""

from __future__ import annotations

from dataclasses import dataclass


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
    num_preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative
    generation_tokens: int = 0  # cumulative
    num_steps: int = 0
    last_step_seconds: float = 0.0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_time: float = 0.0  # time.monotonic() when the loop last finished a step
