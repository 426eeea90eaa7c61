"""Bearer API keys, checked in constant time; probes and /metrics stay open for the kubelet
and Prometheus, like vLLM which guards only the API routes."""

from __future__ import annotations

import hmac
import time
from typing import Callable, Mapping

from fastapi import Request

from ..credentials import CredentialFiles, Credentials
from ..tenancy import Identity, RateLimiter, TenantError, TenantResolver, TenantTable
from .error_body import OpenAIError

# Routes that never need a key: the kubelet's probes and Prometheus cannot send one, routers
# read the cache and tokenizer routes (hashes and a public tokenizer, never prompts), and
# /version and /openapi.json reveal nothing a key protects. Proxies in front of the engine
# (the scale-from-zero gateway) leave the same paths open.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/openapi.json",
                        "/kv/blocks", "/tokenizer_info"})


class ApiKeyCheck:
    """FastAPI dependency: refuses with 401 unless the request carries one of `keys`. With
    `files`, each check first lets them apply a change (their subscribers call `update`)."""

    def __init__(self, keys: list[str], files: CredentialFiles | None = None) -> None:
        self.update(keys)
        self.files = files

    @classmethod
    def following(cls, files: CredentialFiles) -> "ApiKeyCheck":
        """The check of a process without a tenant table: the files' keys, as they change."""
        check = cls(files.current.api_keys, files)
        files.subscribe(lambda credentials: check.update(credentials.api_keys))
        return check

    def update(self, keys: list[str]) -> None:
        self.keys = [key.encode() for key in keys]

    async def __call__(self, request: Request) -> None:
        self.matched(request.headers)

    def matched(self, headers: Mapping[str, str]) -> int | None:
        """The index of the key the request's `headers` carry (None when no key is configured);
        401 otherwise. Headers, not a Request: the endpoint picker checks what Envoy forwards."""
        if self.files is not None:
            self.files.refresh()   # may call update (and the tenant table's subscribers) first
        if not self.keys:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        given = token.strip().encode()
        # NOTE: compare against every key so the time taken does not reveal which one matched.
        matched = [hmac.compare_digest(given, key) for key in self.keys]
        if not any(matched):
            raise OpenAIError(401, "incorrect API key provided", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        return matched.index(True)


class TenantGate:
    """The key check, the tenant table and the quotas, made and replaced together (a key's index
    in `keys` names its owner in `resolver`): the engine's front (api/tenancy.py) and the router
    (router/tenancy.py) each keep one. `api_keys` (--api-keys) stay valid and name no tenant;
    with `files`, all three follow the key files' changes; `share` divides every quota."""

    def __init__(self, table: TenantTable | None, trust_header: bool, api_keys: list[str],
                 files: CredentialFiles | None = None, share: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.resolver = TenantResolver(table, trust_header)
        self.keys = ApiKeyCheck(self.resolver.keys() + api_keys, files)
        self.limiter = RateLimiter(self.resolver.table, share=share, clock=clock)
        if files is not None:
            files.subscribe(self.update)

    def update(self, credentials: Credentials) -> None:
        """New keys, tenants and quotas, all at once (between two requests' checks)."""
        self.resolver.update(credentials.table)
        self.keys.update(self.resolver.keys() + credentials.api_keys)
        self.limiter.update(self.resolver.table)

    def identify(self, headers: Mapping[str, str]) -> Identity:
        """Check the key (401) and name the request's tenant (400 for a bad tenant header)."""
        index = self.keys.matched(headers)
        try:
            return self.resolver.identify(index, headers)
        except TenantError as error:
            raise OpenAIError(400, str(error), param=error.param, code="invalid_tenant") from None
