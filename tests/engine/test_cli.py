"""`kubeinfer generate` and `kubeinfer bench throughput` end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from helpers.tiny_models import make_tiny_llama
from kubeinfer.server.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("cli")))


def test_generate_prints_each_answer(tiny_dir, capsys):
    code = main(["generate", "Hello", "Kubernetes schedules pods", "--model", tiny_dir,
                 "--dtype", "float32", "--max-tokens", "6", "--temperature", "0",
                 "--kv-cache-memory", "4Mi"])
    out = capsys.readouterr().out
    assert code == 0
    assert "### Hello\n" in out and "### Kubernetes schedules pods\n" in out


def test_generate_reports_a_bad_request(tiny_dir, capsys):
    code = main(["generate", "Hello", "--model", tiny_dir, "--dtype", "float32",
                 "--max-tokens", "100000", "--kv-cache-memory", "4Mi"])
    assert code == 2 and "100000 in the completion" in capsys.readouterr().err


@pytest.mark.parametrize("dataset", ["random", "shared-prefix"])
def test_bench_throughput_reports_rates(tiny_dir, tmp_path, dataset, capsys):
    report = tmp_path / "bench.json"
    code = main(["bench", "throughput", "--dataset", dataset, "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "8", "--prefix-len", "64",
                 "--model", tiny_dir, "--dtype", "float32", "--kv-cache-memory", "4Mi",
                 "--json", str(report)])
    result = json.loads(report.read_text())
    assert code == 0 and "output_tokens_per_second" in capsys.readouterr().out
    assert result["num_prompts"] == 4 and result["output_tokens_per_second"] > 0
    assert result["requests_per_second"] > 0 and result["wall_seconds"] > 0
    if dataset == "shared-prefix":  # 3 of 4 requests reuse the 64-token prefix
        assert result["prefix_cache_hit_rate"] == pytest.approx(3 * 64 / (4 * 80))
