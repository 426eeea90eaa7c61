"""Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Sequence

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .sequence import Request

if TYPE_CHECKING:
    from ..model.loader import LoadedModel
    from .spec_decode.speculator import Speculator


class LLM:
    def __init__(self, model: str = "embedded", loaded_model: "LoadedModel | None" = None,
                 speculator: "Speculator | None" = None, **engine_kwargs: Any) -> None:
        """`engine_kwargs` are EngineConfig fields; `loaded_model` reuses an already loaded model;
        `speculator` drafts with a proposer of the caller's (`LLMEngine`)."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), loaded_model, speculator)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[str] | Sequence[list[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, adapter: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `adapter`: the
        LoRA adapter of every prompt, or one per prompt (None: the base model).

        All prompts are validated before any is queued, so a bad one leaves nothing behind.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        requests = [self.engine.make_request(str(next(self._ids)), prompt, p, adapter=name)
                    for prompt, p, name in zip(prompts, params, adapters)]
        return self._run(requests, use_tqdm)

    def embed(self, prompts: Sequence[str] | Sequence[list[int]] | str, dimensions: int | None = None,
              use_tqdm: bool = False) -> list[RequestOutput]:
        """Embed every prompt (an embedding model, `--task embed`); each output's `embedding`
        is a float32 tensor. Outputs come back in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        requests = [self.engine.make_pooling_request(str(next(self._ids)), prompt, dimensions)
                    for prompt in prompts]
        return self._run(requests, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        order = {request.request_id: i for i, request in enumerate(requests)}
        for request in requests:
            self.engine.add_request(request.request_id, request)
        results: list[RequestOutput | None] = [None] * len(requests)
        progress = _progress(len(requests)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[order[output.request_id]] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
