"""The router in front of embedding engines: /v1/embeddings is forwarded like any OpenAI route
(no prefix key: it is routed by load), and the InferenceService's `model.task` reaches the engine."""

from __future__ import annotations

import argparse

import httpx
from fastapi import FastAPI, Request
from isvc_builders import CONFIG, make_isvc
import pytest

from test_autoscaler_scrape import serving
from test_gateway import FakeBackends, gateway

from kubeinfer.operator.build import deployment
from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS, add_flags

pytestmark = pytest.mark.integration


def embedding_engine() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await request.json()
        return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
                "model": body.get("model"), "usage": {"prompt_tokens": 3, "total_tokens": 3}}

    return app


async def test_embeddings_are_forwarded() -> None:
    with serving(embedding_engine()) as engine:
        app, metrics = gateway(FakeBackends([f"http://127.0.0.1:{engine}"]))
        with serving(app) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                answer = await client.post("/v1/embeddings", json={"model": "e", "input": "hi"})
    assert answer.status_code == 200
    assert answer.json()["data"][0]["embedding"] == [0.6, 0.8] and answer.json()["model"] == "e"


def _args(spec: dict) -> argparse.Namespace:
    container = deployment(make_isvc(spec), CONFIG)["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS + SERVER_FLAGS, environ={})
    return parser.parse_args(container["args"][1:])


def test_model_task_is_passed_to_the_engine() -> None:
    assert _args({"model": {"task": "embed"}}).task == "embed"
    assert _args({"model": {"task": "generate"}}).task == "generate"
    assert _args({}).task == "auto"   # unset: the engine decides from the checkpoint


def test_an_unknown_task_is_refused() -> None:
    import pytest
    from pydantic import ValidationError

    from kubeinfer.operator.spec import InferenceServiceSpec

    with pytest.raises(ValidationError, match="'generate' or 'embed'"):
        InferenceServiceSpec.model_validate({"model": {"task": "chat"}})
