"""What every route needs, built once per app: the engine, admission control and metrics."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypeVar

from .admission import Admission
from .errors import OpenAIError
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..engine.async_engine import AsyncEngine
    from .tenancy import Tenancy
    from .tracing import Tracing

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncEngine
    model_source: str
    admission: Admission
    metrics: ServerMetrics
    tenancy: Tenancy | None = None  # tenants, priorities, quotas, metering (--tenants-file, --trust-tenant-header)
    tracing: Tracing | None = None  # OpenTelemetry spans of requests (--otlp-traces-endpoint)
    # Tokenizing and rendering templates: megabytes of text take seconds, and on the event
    # loop that would stall every other request, /health included.
    input_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="kubeinfer-input"))

    @classmethod
    def create(cls, engine: AsyncEngine, model_source: str, max_queued_requests: int) -> ServerState:
        metrics = ServerMetrics(engine.stats, engine.served_model_name, lambda: admission.in_flight,
                                engine.engine.runner.cache_config())
        admission = Admission(engine.stats, max_queued_requests, metrics.observe_rejected)
        return cls(engine, model_source, admission, metrics)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Run CPU-bound input work (tokenizing, templates) in the input pool."""
        return await asyncio.get_running_loop().run_in_executor(self.input_pool, work)

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    def check_model(self, requested: str | None) -> None:
        """An absent model means the served one; a LoRA adapter's name is known too; any other
        name is a 404, as in vLLM."""
        self.resolve_model(requested)

    def resolve_model(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model; 404 otherwise."""
        if requested is None or requested == self.model_name:
            return None
        adapters = self.engine.adapters
        if adapters is not None and adapters.known(requested):
            return requested
        raise OpenAIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")

    def check_task(self, task: str, api: str) -> None:
        """A route of the other task: vLLM's 400 ("The model does not support ... API"), saying why."""
        if self.engine.task != task:
            serves = "embeddings: use /v1/embeddings" if self.engine.task == "embed" else \
                "text generation: start it with --task embed to serve an embedding model"
            raise OpenAIError(400, f"The model does not support {api} API (it serves {serves}).",
                              code="unsupported_task")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
