"""vLLM's runtime LoRA API: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Served only with --enable-lora and runtime updating allowed (--allow-runtime-lora-updating, or
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): on the admin port when there is one (only the
operator calls it; no Service exposes that port), else behind the API key like the OpenAI
routes. Bodies, success texts and error messages are vLLM's, so its clients and
KServe/KubeAI-style controllers work unchanged, except that a path holding no readable adapter
gets one message whatever the filesystem holds there (missing, not a directory, unreadable, no
config or weights): the caller learns nothing about the pod's files. Loading reads and checks the adapter off the event loop and
registers it between engine steps; it takes a device slot when a request first uses it.
Unloading makes new requests for it 404 at once; requests already in flight finish on it.
"""

from __future__ import annotations

import asyncio
import logging
import os

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ..flags import LoRAModuleSpec
from ..model.adapters.lora import LoRAError, LoRAPathError
from .errors import OpenAIError
from .state import ServerState

logger = logging.getLogger(__name__)
VLLM_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool, environ: dict[str, str] | None = None) -> bool:
    """Our flag, or vLLM's environment variable (true/1, as vLLM reads it)."""
    value = (os.environ if environ is None else environ).get(VLLM_RUNTIME_ENV, "0")
    return flag or value.strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str | None = None
    lora_int_id: int | None = None   # vLLM's; names are what identify adapters here


def unreadable(name: str, error: BaseException) -> OpenAIError:
    """The one answer for a path without a readable adapter; the detail goes to the log only."""
    logger.warning("load_lora_adapter %r: %s", name, error)
    return OpenAIError(400, f"The lora adapter '{name}' could not be read: lora_path holds no readable PEFT "
                            "adapter (adapter_config.json and adapter_model.safetensors or .bin).",
                       param="lora_path")


def lora_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    def adapters():
        if state.engine.adapters is None:   # not mounted without --enable-lora; kept for safety
            raise OpenAIError(400, "LoRA is not enabled on this server (--enable-lora)")
        return state.engine.adapters

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if body.lora_name == state.model_name:
            raise OpenAIError(400, f"The lora adapter name '{body.lora_name}' is the base model's name.",
                              param="lora_name")
        registry = adapters()
        if registry.known(body.lora_name):
            raise OpenAIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        module = LoRAModuleSpec(body.lora_name, body.lora_path)
        try:
            weights = await asyncio.get_running_loop().run_in_executor(None, registry.read, module)
        except LoRAError as error:
            if isinstance(error, LoRAPathError):
                raise unreadable(body.lora_name, error) from None
            raise OpenAIError(400, str(error), param="lora_path") from error
        except Exception as error:  # noqa: BLE001 - OSError, a torn safetensors or pickle file: all unreadable
            raise unreadable(body.lora_name, error) from None
        try:
            await state.engine.run_in_engine(
                lambda engine: engine.adapters.register(module, weights, engine.scheduler))
        except ValueError as error:   # LoRAError is a ValueError
            raise OpenAIError(400, str(error), param="lora_path") from error
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name:
            raise OpenAIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        registry = adapters()
        missing = OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                              code="model_not_found")
        if not registry.known(body.lora_name):
            raise missing
        try:
            await state.engine.run_in_engine(
                lambda engine: engine.adapters.unregister(body.lora_name, engine.scheduler))
        except KeyError:
            raise missing from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
