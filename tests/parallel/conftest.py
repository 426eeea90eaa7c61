"""Tensor-parallel engines for the tests: one per process at a time (torch.distributed has one
default group), each torn down (workers stopped, group destroyed) when its test ends."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.parallel.launch import shutdown_tensor_parallel


@pytest.fixture
def make_tp_llm() -> Iterator[Callable[..., LLM]]:
    """make_tp_llm(model, tensor_parallel_size=N, **engine_kwargs) -> LLM whose workers stop after the test."""

    def make(model: str, **engine_kwargs: Any) -> LLM:
        return LLM(model, **engine_kwargs)

    yield make
    shutdown_tensor_parallel()
