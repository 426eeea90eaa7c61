"""Tenants at the engine's HTTP front: who sends a request, at which priority, within which
quota, and how much each tenant used (`kubeinfer serve --tenants-file / --trust-tenant-header`).

The dependency `Tenancy.authenticate` replaces the plain API-key check on the OpenAI routes: it
checks the key the same way, then stores the request's `Identity` on `request.state`. `submit`
(streams.py) then applies the priority bounds and quotas, tags the engine requests with the
tenant for the fair scheduling policy, and `finished` meters each request once.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram

from ..credentials import CredentialFiles
from ..engine.outputs import RequestOutput
from ..tenancy import Identity, TenantError, TenantTable
from .auth import TenantGate
from .error_body import OpenAIError
from .metrics import LATENCY_BUCKETS, TTFT_BUCKETS

usage_log = logging.getLogger("kubeinfer.usage")


class TenantMetrics:
    """Per-tenant counters, labelled by the tenant table's names (bounded, never raw keys)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, ["model_name", "tenant", *extra], registry=registry)

        self.model_name = model_name
        self.prompt = counter("kubeinfer:tenant_prompt_tokens", "Prompt tokens of finished requests, per tenant.")
        self.cached = counter("kubeinfer:tenant_cached_prompt_tokens",
                              "Prompt tokens served from the prefix cache, per tenant.")
        self.completion = counter("kubeinfer:tenant_generation_tokens", "Tokens generated, per tenant.")
        self.requests = counter("kubeinfer:tenant_requests",
                                "Requests (prompts) per tenant by outcome: a finish reason (stop, length, "
                                "abort, error) or a refusal (rate_limited, invalid_priority).", "outcome")
        self.ttft = Histogram("kubeinfer:tenant_time_to_first_token_seconds", "Time to first token, per tenant.",
                              ["model_name", "tenant"], buckets=TTFT_BUCKETS, registry=registry)
        self.queue = Histogram("kubeinfer:tenant_request_queue_time_seconds", "Time spent waiting, per tenant.",
                               ["model_name", "tenant"], buckets=LATENCY_BUCKETS, registry=registry)

    def finished(self, label: str, output: RequestOutput) -> None:
        self.prompt.labels(self.model_name, label).inc(len(output.prompt_token_ids))
        self.cached.labels(self.model_name, label).inc(output.num_cached_tokens)
        self.completion.labels(self.model_name, label).inc(sum(len(c.token_ids) for c in output.outputs))
        reasons = [c.finish_reason or "abort" for c in output.outputs] or [
            "stop" if output.embedding is not None else ("error" if output.error else "abort")]
        self.requests.labels(self.model_name, label, reasons[0]).inc()
        m = output.metrics
        if m.arrival_time is not None and m.first_token_time is not None:
            self.ttft.labels(self.model_name, label).observe(m.first_token_time - m.arrival_time)
        if m.arrival_time is not None and m.first_scheduled_time is not None:
            self.queue.labels(self.model_name, label).observe(m.first_scheduled_time - m.arrival_time)

    def refused(self, label: str, outcome: str, count: int = 1) -> None:
        self.requests.labels(self.model_name, label, outcome).inc(count)


class Tenancy(TenantGate):
    """The engine's front: the gate, per-tenant metering, and the usage log when asked."""

    def __init__(self, table: TenantTable | None, trust_header: bool, api_keys: list[str],
                 registry: CollectorRegistry, model_name: str, log_usage: bool = False,
                 files: CredentialFiles | None = None) -> None:
        super().__init__(table, trust_header, api_keys, files)
        self.metrics = TenantMetrics(registry, model_name)
        self.log_usage = log_usage

    async def authenticate(self, request: Request) -> None:
        """The API-key check, then the request's Identity on `request.state.identity`."""
        request.state.identity = self.identify(request.headers)

    def admit(self, identity: Identity, requested_priority: int | None, num_prompts: int) -> int:
        """The priority to run at; raises 400 (priority out of range) or 429 (over quota)."""
        try:
            priority = self.resolver.priority(identity, requested_priority)
        except TenantError as error:
            self.metrics.refused(identity.label, "invalid_priority", num_prompts)
            raise OpenAIError(400, str(error), param=error.param, code="invalid_priority") from None
        refusal = self.limiter.check(identity.name)
        if refusal is not None:
            self.metrics.refused(identity.label, "rate_limited", num_prompts)
            raise OpenAIError(429, refusal.message, code="rate_limit_exceeded", headers=refusal.headers(),
                              error_type="tokens" if refusal.limit == "tokens_per_minute" else "requests")
        return priority

    def on_finished(self, identity: Identity, reserved: int) -> Callable[[RequestOutput], None]:
        """What to do when one of the request's engine requests finishes: meter it, give back
        the unused part of its token reservation, and log its usage when asked."""
        def finished(output: RequestOutput) -> None:
            used = len(output.prompt_token_ids) + sum(len(c.token_ids) for c in output.outputs)
            self.limiter.refund(identity.name, reserved - used)
            self.metrics.finished(identity.label, output)
            if self.log_usage:
                usage_log.info(json.dumps({
                    "request_id": output.request_id, "tenant": identity.label,
                    "prompt_tokens": len(output.prompt_token_ids), "cached_tokens": output.num_cached_tokens,
                    "completion_tokens": used - len(output.prompt_token_ids),
                    "finish_reasons": [c.finish_reason for c in output.outputs]}))
        return finished
