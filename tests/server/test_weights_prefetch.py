"""Reading a model's weights ahead of the load: which files, how much, and that it finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubeinfer.server.weights import prefetch

pytestmark = pytest.mark.unit


def model_dir(tmp_path: Path) -> Path:
    for name, size in (("config.json", 10), ("model-00002-of-00002.safetensors", 300),
                       ("model-00001-of-00002.safetensors", 500), ("tokenizer.json", 20)):
        (tmp_path / name).write_bytes(b"x" * size)
    return tmp_path


def test_plan_reads_the_weight_files_in_load_order_within_the_budget(tmp_path: Path) -> None:
    model = model_dir(tmp_path)
    assert [(p.name, n) for p, n in prefetch.plan(model, 10_000)] == [
        ("model-00001-of-00002.safetensors", 500), ("model-00002-of-00002.safetensors", 300)]
    assert [(p.name, n) for p, n in prefetch.plan(model, 600)] == [
        ("model-00001-of-00002.safetensors", 500), ("model-00002-of-00002.safetensors", 100)]
    assert prefetch.plan(model, 0) == []
    single = model / "model-00001-of-00002.safetensors"
    assert prefetch.plan(single, 10_000) == [(single, 500)]


def test_prefetch_runs_in_the_background_once_per_file_and_ends(tmp_path: Path) -> None:
    thread = prefetch.prefetch(str(model_dir(tmp_path)))
    assert thread is not None and thread.daemon
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert prefetch.prefetch(tmp_path) is None   # the serve command started it; the loader's call adds nothing
    assert prefetch.prefetch(str(tmp_path / "missing")) is None
