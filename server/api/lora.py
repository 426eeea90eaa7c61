"""vLLM's runtime LoRA API: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Served only with --enable-lora and runtime updating allowed (--allow-runtime-lora-updating, or
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), behind the API key like the OpenAI routes.
Bodies, success texts and error messages are vLLM's, so its clients and KServe/KubeAI-style
controllers work unchanged. Loading reads and checks the adapter off the event loop and
registers it between engine steps; it takes a device slot when a request first uses it.
Unloading makes new requests for it 404 at once; requests already in flight finish on it.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from .errors import OpenAIError
from .state import ServerState
from ..flags import LoRAModuleSpec

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
            await state.engine.run_in_engine(lambda engine: engine.adapters.register(module, weights))
        except (ValueError, OSError) as error:   # LoRAError is a ValueError
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
            await state.engine.run_in_engine(lambda engine: engine.adapters.unregister(body.lora_name))
        except KeyError:
            raise missing from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
