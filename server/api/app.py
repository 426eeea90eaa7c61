"""The FastAPI apps: OpenAI routes behind the API key, probes and /metrics in the open, and
what only the operator and the routers call (runtime LoRA loading, the prefix-cache digest and
the tokenizer description) on an admin port when one is given (`--admin-port`, which no Service
exposes), else on the same port as vLLM does."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..engine.validation import check_token_ids
from ..flags import MIN_BODY_BYTES, default_max_body_bytes
from .auth import ApiKeyCheck
from .cache_routes import cache_routes
from .chat import create_chat_completion, render_request
from .completions import create_completion
from .embeddings import EmbeddingRequest, create_embedding
from .errors import OpenAIError, install_error_handlers
from .lora import lora_routes
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest)
from .responses import ModelCard, ModelList
from .middleware import BodyLimit, RequestClock
from .state import ServerState
from .tenancy import Tenancy
from .streams import ClientDisconnected


def _model_routes(state: ServerState) -> APIRouter:
    """The listing, on the API and on the admin port: the operator reads the adapters there."""
    router = APIRouter()

    def cards() -> list[ModelCard]:
        """The base model, then each LoRA adapter with `parent` = the base (vLLM's listing)."""
        max_model_len = state.engine.max_model_len
        base = ModelCard(id=state.model_name, root=state.model_source, max_model_len=max_model_len)
        adapters = state.engine.adapters.modules() if state.engine.adapters is not None else []
        return [base] + [ModelCard(id=module.name, root=module.path, parent=module.base_model_name or state.model_name,
                                   max_model_len=max_model_len) for module in adapters]

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=cards())

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        state.check_model(model_id)
        card = next((card for card in cards() if card.id == model_id), None)
        if card is None:   # an adapter unloaded in between
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return card

    return router


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(body, request, state)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's: the ids the engine would run (a prompt, or messages through the chat template
        as /v1/chat/completions renders them), with their token strings on request."""
        state.check_model(body.model)
        tokenizer = state.engine.tokenizer

        text = body.prompt or ""
        if body.messages is not None:
            text, _ = await render_request(state, ChatCompletionRequest(
                messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs))

        def encode() -> tuple[list[int], list[str] | None]:
            ids = tokenizer.encode(text, add_special_tokens=body.special_tokens)
            return ids, tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

        ids, strings = await state.off_loop(encode)
        response = {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}
        return response | {"token_strs": strings} if strings is not None else response

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        check_token_ids(body.tokens, state.engine.tokenizer.vocab_size, "tokens")
        text = await state.off_loop(lambda: state.engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
        return {"prompt": text}

    return router


def _ops_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        """Liveness: the engine loop runs and steps whenever it has work."""
        if state.engine.is_alive():
            return Response(status_code=200)
        raise OpenAIError(503, "engine loop is not running")

    @router.get("/ready")
    async def ready() -> Response:
        """Readiness: fails as soon as draining starts or the engine loop stops, so the Service
        and the router stop sending work here at once."""
        if not state.engine.is_alive():
            raise OpenAIError(503, "engine loop is not running", code="engine_dead")
        if state.admission.draining:
            raise OpenAIError(503, "draining", code="draining")
        return Response(status_code=200)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    return router


def _app(state: ServerState, max_body_bytes: int | None) -> FastAPI:
    app = FastAPI(title="kubeinfer", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    if max_body_bytes:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    else:
        app.add_middleware(BodyLimit, max_bytes=lambda: default_max_body_bytes(state.engine.max_model_len),
                           at_least=MIN_BODY_BYTES)
    app.add_middleware(RequestClock)   # outermost: the moment a request reaches the app

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    return app


def _admin_routes(app: FastAPI, state: ServerState, runtime_lora_updating: bool,
                  dependencies: list) -> None:
    if runtime_lora_updating and state.engine.adapters is not None:
        app.include_router(lora_routes(state), dependencies=dependencies)
    app.include_router(cache_routes(state))


def build_app(state: ServerState, api_keys: list[str] | ApiKeyCheck, max_body_bytes: int | None = None,
              runtime_lora_updating: bool = False, admin_port: bool = False,
              tenancy: Tenancy | None = None) -> FastAPI:
    """`api_keys`: the keys, or the check that follows the key files; `max_body_bytes` defaults
    to `default_max_body_bytes` of the engine's context;
    `runtime_lora_updating` mounts the LoRA load/unload routes (with --enable-lora);
    `admin_port`: those and the cache routes are left to `build_admin_app`; `tenancy` (the
    state's) checks keys and names tenants in place of the plain key check."""
    app = _app(state, max_body_bytes)
    check = api_keys if isinstance(api_keys, ApiKeyCheck) else ApiKeyCheck(api_keys)
    keyed = [Depends(tenancy.authenticate if tenancy is not None else check)]
    app.include_router(_api_routes(state), dependencies=keyed)
    app.include_router(_model_routes(state), dependencies=keyed)
    app.include_router(_ops_routes(state))
    if not admin_port:
        _admin_routes(app, state, runtime_lora_updating, keyed)
    return app


def build_admin_app(state: ServerState, max_body_bytes: int | None = None,
                    runtime_lora_updating: bool = False) -> FastAPI:
    """The admin port's app: no user's API key opens or is needed on it (a user's key must not
    reach the operator's routes); who may connect is the network's decision (no Service, and
    the chart's NetworkPolicy option)."""
    app = _app(state, max_body_bytes)
    app.include_router(_model_routes(state))
    _admin_routes(app, state, runtime_lora_updating, [])
    return app


class PortDispatch:
    """One ASGI app for one uvicorn server bound to two ports: a connection accepted on
    `admin_port` reaches `admin`, any other `public` (which also runs the lifespan)."""

    def __init__(self, public: ASGIApp, admin: ASGIApp, admin_port: int) -> None:
        self.public, self.admin, self.admin_port = public, admin, admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") or (None, None)
        app = self.admin if scope["type"] == "http" and server[1] == self.admin_port else self.public
        await app(scope, receive, send)
