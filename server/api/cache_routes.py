"""What a prefix-aware router reads from this engine: its cached blocks and its tokenizer.

`GET /kv/blocks?since=SEQ` answers the block hashes stored and evicted since SEQ (the whole
set when `reset` is true); `GET /tokenizer_info` answers the tokenizer, chat template and
special tokens, so a router tokenizes exactly as this engine does. Both are on the admin port
when there is one (`app.py`), else outside the API key like /metrics: they reveal hashes (keyed
per InferenceService with --kv-hash-key, salted per tenant with `cache_salt`) and the model's
public tokenizer, never prompts.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Query, Response

from ..engine.kv_events import HASH_SCHEME
from .errors import OpenAIError
from .state import ServerState


def cache_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    tokenizer_info: bytes | None = None

    @router.get("/kv/blocks")
    async def kv_blocks(since: int | None = Query(None, ge=0)) -> dict:
        events = state.engine.kv_events
        if events is None:
            raise OpenAIError(404, "prefix caching is off on this engine (--enable-prefix-caching)",
                              code="prefix_caching_disabled")
        return events.since(since)

    @router.get("/tokenizer_info")
    async def tokenizer() -> Response:
        nonlocal tokenizer_info
        if tokenizer_info is None:   # ~2 MB of JSON for a 50k vocabulary: built once
            events = state.engine.kv_events
            tokenizer_info = json.dumps({
                "model": state.model_name, **state.engine.tokenizer.describe(),
                "block_size": events.block_size if events is not None else None,
                "hash": events.hasher.scheme if events is not None else HASH_SCHEME}).encode()
        return Response(tokenizer_info, media_type="application/json")

    return router
