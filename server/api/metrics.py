"""Prometheus metrics under vLLM's names, so vLLM dashboards and autoscalers work unchanged.

Gauges and engine counters are read from `engine.stats()` at scrape time by a collector:
the queue-depth gauges the autoscaler reads are then exact at every scrape instead of
lagging by an update interval. Per-request histograms are observed as requests finish.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.outputs import RequestOutput
from ..engine.stats import EngineStats, SpecDecodeStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily
# (family, name, help, value read from an EngineStats snapshot)
_ENGINE_METRICS: tuple[tuple[type, str, str, Callable[[EngineStats], float]], ...] = (
    (_GAUGE, "vllm:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    (_GAUGE, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    (_GAUGE, "vllm:kv_cache_usage_perc", "KV-cache blocks in use (0..1).", lambda s: s.kv_cache_usage),
    (_COUNTER, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache_queries),
    (_COUNTER, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.prefix_cache_hits),
    (_GAUGE, "kubeinfer:prefix_cache_hits_recent",
     "Prompt tokens found in the prefix cache, exponentially decayed: each token counts half after "
     "600 s (credited at 15 s wall-clock boundaries, so readers within one interval agree). The "
     "operator sets the pod-deletion-cost from it: a scale-down removes the replica whose cache served "
     "least of late.", lambda s: s.recent_prefix_cache_hits.value(time.time())),
    (_COUNTER, "vllm:num_preemptions", "Requests preempted by the scheduler.", lambda s: s.num_preemptions),
    (_COUNTER, "vllm:prompt_tokens", "Prefill tokens processed.", lambda s: s.prompt_tokens),
    (_COUNTER, "vllm:generation_tokens", "Tokens generated.", lambda s: s.generation_tokens),
    (_COUNTER, "kubeinfer:engine_steps", "Engine steps (forward passes) run.", lambda s: s.num_steps),
    (_GAUGE, "kubeinfer:engine_step_seconds", "Duration of the last engine step.",
     lambda s: s.last_step_seconds),
    (_GAUGE, "kubeinfer:batch_tokens", "Tokens computed in the last engine step.",
     lambda s: s.last_step_tokens),
    (_GAUGE, "kubeinfer:batch_size", "Sequences in the last engine step.", lambda s: s.last_step_seqs),
    (_GAUGE, "kubeinfer:kv_cache_blocks_total", "KV-cache blocks in the pool.", lambda s: s.num_blocks_total),
    (_GAUGE, "kubeinfer:kv_cache_blocks_free",
     "KV-cache blocks on the free list; excludes evictable blocks that only hold cached prefixes "
     "(kubeinfer:kv_cache_blocks_evictable), which are reclaimed when needed.", lambda s: s.num_blocks_free),
    (_GAUGE, "kubeinfer:kv_cache_blocks_evictable",
     "KV-cache blocks holding only cached prefixes: reusable by a new request at once.",
     lambda s: s.num_blocks_evictable),
)


class EngineStatsCollector(Collector):
    """Turns one exact `EngineStats` snapshot into gauges and counters per scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 in_flight: Callable[[], int], cache_config: dict[str, str] | None = None) -> None:
        self.stats, self.model_name, self.in_flight = stats, model_name, in_flight
        self.cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        snapshot = self.stats()
        for family, name, doc, read in _ENGINE_METRICS:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], float(read(snapshot)))
            yield metric
        in_flight = _GAUGE("kubeinfer:num_requests_in_flight", "HTTP requests being served.",
                           labels=["model_name"])
        in_flight.add_metric([self.model_name], float(self.in_flight()))
        yield in_flight
        if self.cache_config:   # vLLM's info gauge: block size, cache dtype, blocks
            info = _GAUGE("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                          labels=list(self.cache_config))
            info.add_metric(list(self.cache_config.values()), 1.0)
            yield info
        if snapshot.max_lora:
            # vLLM's form: one sample whose labels list the adapters and whose value is the time
            info = _GAUGE("vllm:lora_requests_info", "Running stats on LoRA requests.",
                          labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric([str(snapshot.max_lora), ",".join(snapshot.waiting_lora_adapters),
                             ",".join(snapshot.running_lora_adapters)], time.time())
            yield info
        if snapshot.spec_decode is not None:
            yield from self._spec_decode(snapshot.spec_decode)

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's spec-decode counters (only with speculative decoding on, as vLLM)."""
        for name, doc, value in (
                ("vllm:spec_decode_num_drafts", "Sequence-steps that scored draft tokens.", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens scored.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
            metric = _COUNTER(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], float(value))
            yield metric
        per_pos = _COUNTER("vllm:spec_decode_num_accepted_tokens_per_pos",
                           "Draft tokens accepted, by position among a step's drafts (0 = first).",
                           labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], float(value))
        yield per_pos


class ServerMetrics:
    """The server's own registry (never the global one: tests build many apps per process)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 in_flight: Callable[[], int], cache_config: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineStatsCollector(stats, model_name, in_flight, cache_config))
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time per output token of each request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time spent waiting.", LATENCY_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests by reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter("kubeinfer:requests_rejected", "Requests refused with 503.",
                                ["model_name", "reason"], registry=self.registry)
        self.lora_requests = Counter("kubeinfer:lora_requests", "Requests (prompts) started per LoRA adapter.",
                                     ["model_name", "adapter"], registry=self.registry)

    def observe_token_gaps(self, seconds: float, num_gaps: int) -> None:
        """`num_gaps` tokens arrived `seconds` after the previous delivery: the first of them
        waited that long, the rest came with it (so a request adds output tokens - 1 samples)."""
        if num_gaps > 0:
            self.itl.observe(seconds)
        for _ in range(num_gaps - 1):
            self.itl.observe(0.0)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m.arrival_time is not None:
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.e2e.observe((m.finished_time or time.monotonic()) - m.arrival_time)
        if not output.outputs:   # an embedding request: pooled ("stop") or aborted
            self.success.labels(self.model_name, "stop" if output.embedding is not None else "abort").inc()
        for choice in output.outputs:
            self.success.labels(self.model_name, choice.finish_reason or "abort").inc()
            if len(choice.token_ids) > 1 and m.first_token_time and m.last_token_time:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (len(choice.token_ids) - 1))

    def observe_aborted(self, num_choices: int) -> None:
        self.success.labels(self.model_name, "abort").inc(num_choices)

    def observe_lora_requests(self, adapter: str, count: int) -> None:
        self.lora_requests.labels(self.model_name, adapter).inc(count)

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
