"""The Triton kernels compiled for a real NVIDIA GPU, in the dtypes the interpreter cannot check.

Everything here is skipped without CUDA, and when another folder's conftest has pinned Triton's
interpreter for this process (`tests/kernels` does): `make test` runs this folder in a pytest
process of its own (`python -m pytest -q tests/gpu`), and says in one line when it skipped.
"""

import pytest
import torch

_WHY: list[str] = []  # why this process skips them


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import triton

    if not torch.cuda.is_available():
        why = "no CUDA device: these tests compile the Triton kernels for a real GPU"
    elif triton.knobs.runtime.interpret:
        why = "Triton's interpreter is pinned in this process (tests/kernels); run `pytest tests/gpu` alone"
    else:
        return
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=why))
    _WHY[:] = [why]


def pytest_terminal_summary(terminalreporter) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "tests/gpu/" in r.nodeid]
    if skipped and _WHY:
        terminalreporter.write_sep("=", f"GPU TESTS NOT RUN: {len(skipped)} skipped, {_WHY[0]}", yellow=True, bold=True)
