"""Drive an engine until its requests finish and collect their tokens (engine-level tests)."""

from __future__ import annotations

from kubeinfer.server.engine.llm_engine import LLMEngine
from kubeinfer.server.engine.outputs import RequestOutput
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine.sequence import Request


def generate_tokens(engine: LLMEngine, prompts: list[list[int]],
                    params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Add the prompts (one SamplingParams for all, or one each), step until every request is
    done; each request's output token ids, in prompt order. A request that errors fails the test."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    start = len(engine.requests)
    ids = [f"gen-{start + i}-{id(engine)}" for i in range(len(prompts))]
    for request_id, prompt, request_params in zip(ids, prompts, each):
        engine.add_request(request_id, prompt, request_params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return [outputs[request_id] for request_id in ids]


def run_requests(engine: LLMEngine, requests: list[Request]) -> dict[str, RequestOutput]:
    """Add requests made by `engine.make_request` (with parts a test attached to them), step until
    all are done; the last output of each, by request id."""
    for request in requests:
        engine.add_request(request.request_id, request)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            done[output.request_id] = output
    return done
