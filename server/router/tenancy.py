"""Tenants at the router (`kubeinfer route --tenants-file / --trust-tenant-header`): the same
tenant table and headers as the engine (server/tenancy.py), checked before a request holds or
wakes anything, with each router replica enforcing its share of every quota.

Replicas agree by division, not by talking: with `--quota-replicas N` each enforces
`quota / N`. When the Service spreads requests evenly, N replicas admit the quota together
within one second's worth of it plus one request per replica; a replica that receives more than
its share of a tenant's traffic refuses early (the error is bounded by the imbalance).

Tokens: a request is admitted while its tenant's token bucket is above zero; it reserves an
estimate as it is admitted (its body's bytes / 4 for the prompt, plus `n * max_tokens`), so the
requests in flight count before their answers end, and when it ends the tokens its answer's
`usage` reports (always in a plain answer; in a stream with `stream_options.include_usage`)
take the estimate's place. Without usage (an error, a stream without it, a client gone) the
estimate is given back: such a request counts against the requests-per-minute quota only, and
the engine's own limit (same table) counts its tokens.

Both of the router's faces use this one class: the HTTP proxy (proxy.py) and the endpoint
picker behind Envoy (ext_proc.py), which sees the same headers (Envoy forwards them) and the
answer's body as it streams back. Refusals are counted per tenant in
`kubeinfer:tenant_requests_total{outcome="rate_limited"|"invalid_priority"}`, the engine's
counter: a refused request never reaches an engine, so summed over the router and engine pods
each request counts once.
"""

from __future__ import annotations

import json
import re
import time
from typing import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter

from ..api.auth import TenantGate
from ..api.error_body import OpenAIError
from ..credentials import CredentialFiles
from ..tenancy import Identity, TenantError, TenantTable
from .queue import Ticket

PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
REPLAY_ESTIMATE = 16384   # tokens estimated for a body too large to hold (over 64 KiB)
MAX_ESTIMATE = 1 << 20    # a request's generated tokens estimated at most (a wild max_tokens)


class RouterTenancy(TenantGate):
    def __init__(self, table: TenantTable | None, trust_header: bool, replicas: int,
                 api_keys: list[str], files: CredentialFiles | None = None,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """Each replica enforces 1/`replicas` of every quota. `registry`: the router's metrics,
        where the per-tenant refusals are counted; `clock`: the quotas'."""
        if replicas < 1:
            raise ValueError(f"--quota-replicas must be >= 1, got {replicas}")
        super().__init__(table, trust_header, api_keys, files, share=1.0 / replicas, clock=clock)
        self.refused = Counter("kubeinfer:tenant_requests", "Requests refused at the router, per tenant, by "
                               "outcome (rate_limited, invalid_priority); the engines count the rest.",
                               ["tenant", "outcome"], registry=registry or CollectorRegistry())

    def admit(self, headers: Mapping[str, str]) -> Identity:
        """Check the key, name the tenant and take one request of its quota: 401, 400 or 429."""
        identity = self.identify(headers)
        refusal = self.limiter.check(identity.name)
        if refusal is not None:
            self.refused.labels(identity.label, "rate_limited").inc()
            raise OpenAIError(429, refusal.message, code="rate_limit_exceeded", headers=refusal.headers(),
                              error_type="tokens" if refusal.limit == "tokens_per_minute" else "requests")
        return identity

    def ticket(self, identity: Identity, path: str, body: bytes | object) -> Ticket:
        """The request's place in the router's queue: its tenant, its priority (the engine's
        rules: a trusted gateway's objective, else the body's `priority`, else the tenant's;
        400 when out of range) and its estimated tokens (prompt bytes / 4 plus `n` times the
        most it may generate). A body the router streams (`body` not bytes) or cannot read
        keeps the tenant's priority; the engine answers a malformed one."""
        fields: dict = {}
        if isinstance(body, bytes) and path.strip("/") in ("v1/completions", "v1/chat/completions"):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            fields = parsed if isinstance(parsed, dict) else {}
        requested = fields.get("priority")
        try:
            priority = self.resolver.priority(identity, requested if isinstance(requested, int) else None)
        except TenantError as error:
            self.refused.labels(identity.label, "invalid_priority").inc()
            raise OpenAIError(400, str(error), param=error.param, code="invalid_priority") from None
        most, count = fields.get("max_completion_tokens", fields.get("max_tokens")), fields.get("n")
        generated = ((most if isinstance(most, int) and most > 0 else 0)
                     * (count if isinstance(count, int) and count > 0 else 1))
        prompt = len(body) // 4 if isinstance(body, bytes) else REPLAY_ESTIMATE
        return Ticket(identity.name, priority, prompt + min(generated, MAX_ESTIMATE))

    def reservation(self, identity: Identity, ticket: Ticket,
                    on_tokens: Callable[[int], None] | None = None) -> Callable[[bytes | None], None]:
        """Takes the request's estimated tokens from its tenant's bucket now, so requests in
        flight count before their answers end. The function returned, called with the answer's
        tail (None: no answer, or one without usage; only the first call counts), puts the
        usage in place of the estimate and passes the tokens to `on_tokens`."""
        self.limiter.reserve(identity.name, ticket.cost)
        settled = False

        def settle(tail: bytes | None) -> None:
            nonlocal settled
            if not settled:
                settled = True
                tokens = self.settle(identity, ticket, tail)
                if tokens is not None and on_tokens is not None:
                    on_tokens(tokens)
        return settle

    def settle(self, identity: Identity, ticket: Ticket, tail: bytes | None) -> int | None:
        """Put the tokens of the answer's usage (its last object, in `tail`) in place of the
        reserved estimate and return them; None (the estimate given back) when there is no
        usage: no answer, an error, a stream without `include_usage`."""
        prompt = PROMPT_TOKENS.findall(tail) if tail else []
        completion = COMPLETION_TOKENS.findall(tail) if tail else []
        if not (prompt and completion):
            self.limiter.refund(identity.name, ticket.cost)
            return None
        tokens = int(prompt[-1]) + int(completion[-1])
        if tokens >= ticket.cost:
            self.limiter.reserve(identity.name, tokens - ticket.cost)
        else:
            self.limiter.refund(identity.name, ticket.cost - tokens)
        return tokens
