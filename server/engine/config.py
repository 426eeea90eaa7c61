"""Engine configuration: one field per entry of `server.flags.ENGINE_FLAGS`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from ..flags import (ENGINE_FLAGS, KV_CACHE_DTYPES, LM_HEAD_QUANTIZATIONS, QUANTIZATION_METHODS, RUNNERS,
                     SCHEDULING_POLICIES, TASKS, LoRAModuleSpec)
from .kv_event_publisher import KVEventsConfig, parse_kv_events_config
from .spec_decode.config import SpeculativeConfig, parse_speculative_config


@dataclass
class EngineConfig:
    """Validated engine knobs; the defaults mirror ENGINE_FLAGS so `EngineConfig()` is the CLI default."""

    model: str = "embedded"
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "auto"
    quantize_lm_head: str = "auto"
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_hash_key: str | None = field(default=None, repr=False)  # a secret: never in a log line
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    seed: int = 0
    enable_lora: bool = False
    lora_modules: list[LoRAModuleSpec] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: SpeculativeConfig | None = None  # a dict or JSON text is parsed
    task: str = "auto"
    runner: str = "auto"
    enforce_eager: bool = False
    kv_events_config: KVEventsConfig | None = None  # a dict or JSON text is parsed
    scheduling_policy: str = "auto"
    priority_aging_seconds: float | None = None

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= block_size ({self.block_size})")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization not in ("auto", "none", *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of auto, none, {', '.join(QUANTIZATION_METHODS)}; "
                             f"got {self.quantization!r}")
        if self.quantize_lm_head not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(f"quantize_lm_head must be one of {', '.join(LM_HEAD_QUANTIZATIONS)}; "
                             f"got {self.quantize_lm_head!r}")
        if self.quantize_lm_head == "q8_0" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("quantize_lm_head q8_0 runs in one process: not with tensor or pipeline parallelism")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        if self.runner != "auto":   # vLLM's spelling: the same choice as task
            task = "embed" if self.runner == "pooling" else "generate"
            if self.task not in ("auto", task):
                raise ValueError(f"--runner {self.runner} conflicts with --task {self.task}")
            self.task = task
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if self.priority_aging_seconds is not None and self.priority_aging_seconds <= 0:
            raise ValueError(f"priority_aging_seconds must be positive, got {self.priority_aging_seconds}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes); got node_rank {self.node_rank} of nnodes {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks cannot be "
                             f"spread evenly over {self.nnodes} nodes")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.pipeline_parallel_size > 1 and self.enable_lora:
            raise ValueError("--enable-lora with --pipeline-parallel-size > 1 is not supported yet")
        if (self.speculative_config is not None and self.speculative_config.method == "draft_model"
                and self.world_size > 1):
            raise ValueError("a speculative draft model with tensor_parallel_size > 1 is not supported yet, nor "
                             "with pipeline_parallel_size > 1 "
                             "(the draft would run on one device beside the sharded target); use method "
                             "ngram or suffix")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names = [module.name for module in self.lora_modules or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {', '.join(names)}")

    @property
    def world_size(self) -> int:
        """Ranks over all nodes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """Read the ENGINE_FLAGS dests from a parsed namespace (missing ones keep defaults)."""
        known = {f.name for f in fields(cls)}
        values = {flag.dest: getattr(args, flag.dest) for flag in ENGINE_FLAGS
                  if flag.dest in known and hasattr(args, flag.dest)}
        return cls(**values)
