"""`benchmarks/gpu_check.sh` in its dry run (issue 43): on a machine without a GPU the script a lent
GPU machine runs is checked end to end on the CPU, so the short GPU slots are not spent finding a
broken script. Every step runs or says it was skipped, and every throughput run reports figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
RUNS = ["warmup", "c32-eager-true-1", "c256-eager-true-1", "c32-eager-false-1", "c256-eager-false-1",
        "random-c256", "random-c32", "shared-prefix-c64"]


def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "DRY_RUN": "1", "ROUNDS": "1", "STEPS": "tests kernels tune throughput graphs",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}   # its python3 is ours
    done = subprocess.run(["bash", str(REPO / "benchmarks/gpu_check.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "summary.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "dry run on the CPU: no GPU" in summary
    assert re.search(r"\d+ tests collected", summary) and "rc=0" in (tmp_path / "tests.log").read_text()
    assert "bench-kernels: skipped in a dry run" in summary and "tune: skipped in a dry run" in summary
    for run in RUNS:
        figures = re.findall(rf"^{run} rc=0: .*output_tokens_per_second ([0-9.]+)", summary, re.M)
        assert figures and float(figures[-1]) > 0, f"{run} reported no throughput:\n{summary}"
    assert summary.rstrip().endswith("done")
