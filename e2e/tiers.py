"""Test tiers, marked in the test files (`pytestmark = pytest.mark.unit`, or on one test):

- unit: in-process and quick: no server processes, no 30-layer model (`make test-unit`, the
  developer's loop: under 3 minutes on 2 vCPUs);
- integration: real servers (subprocesses or uvicorn in a thread) and other processes, the
  embedded 30-layer model against transformers, tensor parallelism across processes, kernels
  under Triton's interpreter and the CPU kernels across build variants, the GPU tests;
- e2e: the local Kubernetes cluster (e2e/);
- release: what users paste: the README's commands (`e2e/test_readme.py`).

`make test` runs them all. Both conftests (tests/, e2e/) refuse a run in which a test has no tier
or more than one, so a new test file cannot slip out of `make test-unit` or into it unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e", "release")


def check_tiers(items: list[pytest.Item], folder: Path) -> None:
    """Every test under `folder` has exactly one tier marker."""
    wrong = []
    for item in items:
        if Path(str(item.path)).is_relative_to(folder):
            tiers = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
            if len(tiers) != 1:
                wrong.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one tier marker (" + " / ".join(TIERS) + "), e.g. "
            "`pytestmark = pytest.mark.unit` at the top of its module (see e2e/tiers.py):\n  "
            + "\n  ".join(wrong[:20]) + (f"\n  ... and {len(wrong) - 20} more" if len(wrong) > 20 else ""))
