"""The CPU budget follows a pod's cgroup CPU limit."""

import os

import pytest

from kubeinfer.server.engine.cpu_threads import cpu_budget

pytestmark = pytest.mark.unit


def test_cpu_budget_follows_the_cgroup_quota(tmp_path):
    visible = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert cpu_budget(cpu_max) == visible
    cpu_max.write_text("50000 100000\n")  # half a CPU still gets one thread
    assert cpu_budget(cpu_max) == 1
    cpu_max.write_text(f"{100000 * (visible + 8)} 100000\n")  # never above the affinity
    assert cpu_budget(cpu_max) == visible
    assert cpu_budget(tmp_path / "missing") == visible
