"""Match torch's CPU threads to the CPUs the process may really use.

torch starts one thread per visible core, but a pod's CPU limit (cgroup v2 `cpu.max`) can be
far lower than the node's core count. With more threads than CPU time, every op's barrier
waits on a descheduled thread: on a 2-core machine under load a bf16 matvec was 20 times
slower with 2 threads than with 1 (BENCHMARKS.md, "Figures that were in code comments").
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cpu_budget(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity, capped by the cgroup quota when one is set."""
    count = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return count
    if quota == "max":
        return count
    return max(1, min(count, math.ceil(int(quota) / int(period))))


def limit_torch_threads() -> None:
    import torch

    budget = cpu_budget()
    if torch.get_num_threads() > budget:
        log.info("torch CPU threads lowered from %d to the CPU limit of %d",
                 torch.get_num_threads(), budget)
        torch.set_num_threads(budget)
