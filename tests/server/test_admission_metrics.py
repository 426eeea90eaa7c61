"""Admission control and the metrics registry against scripted engine stats."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.server.api.admission import Admission
from kubeinfer.server.api.errors import OpenAIError
from kubeinfer.server.api.metrics import ServerMetrics
from kubeinfer.server.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kubeinfer.server.engine.stats import EngineStats

pytestmark = pytest.mark.unit


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_gauges_and_counters_are_read_at_scrape_time() -> None:
    stats = EngineStats(num_running=3, num_waiting=5, kv_cache_usage=0.25, prefix_cache_queries=100,
                        prefix_cache_hits=40, num_preemptions=2, prompt_tokens=100, generation_tokens=7)
    metrics = ServerMetrics(lambda: stats, "m", lambda: 8)
    label = (("model_name", "m"),)
    samples = _samples(metrics)
    assert samples[("vllm:num_requests_waiting", label)] == 5
    assert samples[("vllm:num_requests_running", label)] == 3
    assert samples[("vllm:kv_cache_usage_perc", label)] == 0.25
    assert samples[("vllm:prefix_cache_queries_total", label)] == 100
    assert samples[("vllm:prefix_cache_hits_total", label)] == 40
    assert samples[("kubeinfer:prefix_cache_hits_recent", label)] == 0   # none settled yet
    assert samples[("vllm:num_preemptions_total", label)] == 2
    assert samples[("kubeinfer:num_requests_in_flight", label)] == 8
    stats.num_waiting = 0
    assert _samples(metrics)[("vllm:num_requests_waiting", label)] == 0


def test_finished_requests_fill_histograms_and_success_counter() -> None:
    metrics = ServerMetrics(EngineStats, "m", lambda: 0)
    timing = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                            last_token_time=4.0, finished_time=4.0)
    choice = CompletionOutput(0, "abc", [1, 2, 3], "", [], None, "length", None)
    metrics.observe_finished(RequestOutput("r", [5], 0, [choice], True, timing))
    metrics.observe_aborted(1)
    samples = _samples(metrics)
    label = (("model_name", "m"),)
    assert samples[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert samples[("vllm:time_to_first_token_seconds_sum", label)] == 1.0
    assert samples[("vllm:request_queue_time_seconds_sum", label)] == 0.5
    assert samples[("vllm:e2e_request_latency_seconds_sum", label)] == 3.0
    assert samples[("vllm:request_time_per_output_token_seconds_sum", label)] == 1.0
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    assert samples[("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "m")))] == 1


def test_admission_refuses_when_queue_full_or_draining() -> None:
    stats = EngineStats(num_running=1, num_waiting=0)
    rejected: list[str] = []
    admission = Admission(lambda: stats, max_queued_requests=2, on_reject=rejected.append)
    admission.admit()          # the running one
    admission.admit()          # waits: 1 queued
    admission.admit()          # waits: 2 queued
    with pytest.raises(OpenAIError) as info:
        admission.admit()
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "1"
    assert info.value.code == "queue_full"
    admission.release()
    admission.admit()
    admission.draining = True
    with pytest.raises(OpenAIError) as info:
        admission.admit()
    assert info.value.code == "draining" and rejected == ["queue_full", "draining"]


def test_cache_config_info_names_the_kv_cache_dtype() -> None:
    """vLLM's info gauge: a dashboard tells an fp8 cache and its block count apart."""
    config = {"block_size": "16", "cache_dtype": "fp8", "num_gpu_blocks": "546", "calculate_kv_scales": "False"}
    samples = _samples(ServerMetrics(EngineStats, "m", lambda: 0, config))
    assert samples[("vllm:cache_config_info", tuple(sorted(config.items())))] == 1.0
    assert not any(name == "vllm:cache_config_info" for name, _ in _samples(ServerMetrics(EngineStats, "m", lambda: 0)))
