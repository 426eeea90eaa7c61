"""The Triton kernels compiled for a real NVIDIA GPU, in the dtypes the interpreter cannot check.

Everything here is skipped without CUDA, and when another folder's conftest has pinned Triton's
interpreter for this process (`tests/kernels` does): run it alone on a GPU machine,
`python -m pytest -q tests/gpu`.
"""

import pytest
import torch


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
