"""Tenants: who a request belongs to, its priority, and the per-tenant quotas.

A leaf module (pydantic and yaml, and the flags' key parser) shared by `kubeinfer serve`
(server/api/tenancy.py) and the router, so both read one tenant file the same way:

    priority_range: [0, 10]          # optional; the bounds of any request's priority
    objectives: {interactive: 0, batch: 8}   # optional; names a gateway may send for a priority
    tenants:
      - name: team-a
        keys: [sk-team-a-1]          # API keys (Bearer) that identify the tenant
        keys_file: keys/team-a       # and/or a file of them (relative to this file's directory)
        priority: 2                  # its requests' default, and the best they may ask for
        quotas: {tokens_per_minute: 60000, requests_per_minute: 120}

A keys file holds keys as `--api-keys-file` does (one per line or comma-separated, blank and
'#' lines skipped), so the tenant table itself need not hold a key: the operator renders it
without keys and mounts each tenant's Secret beside it.

Lower priority values are served first (vLLM's convention). A request's tenant comes from its
API key, or, with `trust_header`, from the GIE/llm-d fairness header a trusted gateway sets;
such headers from untrusted clients are ignored (documented in docs/tenancy.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo,
                      model_validator)

from .flags import parse_api_keys

FAIRNESS_HEADERS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
TENANT_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_HEADER_TENANT = re.compile(r"^[\x21-\x7e]{1,128}$")   # printable ASCII, no spaces
ANONYMOUS = ""            # the tenant of a request nobody named
UNKNOWN_LABEL = "unknown"  # its metric label
OTHER_LABEL = "other"      # the label of header-named tenants past MAX_HEADER_LABELS
MAX_HEADER_LABELS = 64     # header-named tenants (not in the table) that get a label of their own
DEFAULT_PRIORITY_RANGE = (-100, 100)


class TenantError(ValueError):
    """A request's tenant or priority is not acceptable; `param` names the field or header."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Quotas(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    tokens_per_minute: PositiveInt | None = Field(None, alias="tokensPerMinute")
    requests_per_minute: PositiveInt | None = Field(None, alias="requestsPerMinute")


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TENANT_NAME_PATTERN)
    keys: list[str] = Field(default_factory=list)
    keys_file: str | None = Field(None, min_length=1)
    priority: int = 0
    quotas: Quotas = Field(default_factory=Quotas)

    @model_validator(mode="after")
    def _read_keys_file(self, info: ValidationInfo) -> "TenantSpec":
        """Add the keys of `keys_file` (relative to the context's `base`, the tenant file's
        directory); the table's checks then see them. Errors name the file, never a key."""
        if self.keys_file is None:
            return self
        path = Path((info.context or {}).get("base", ".")) / self.keys_file
        try:
            file_keys = parse_api_keys(path.read_text())
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"keys_file {path}: cannot read it ({type(error).__name__})") from None
        if not file_keys:
            raise ValueError(f"keys_file {path} holds no API key")
        self.keys = [*self.keys, *file_keys]
        return self


class TenantTable(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    tenants: list[TenantSpec] = Field(default_factory=list)
    priority_range: tuple[int, int] = Field(DEFAULT_PRIORITY_RANGE, alias="priorityRange")
    objectives: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> "TenantTable":
        low, high = self.priority_range
        if low > high:
            raise ValueError(f"priority_range: {low} is above {high}")
        names = [t.name for t in self.tenants]
        for name in {n for n in names if names.count(n) > 1}:
            raise ValueError(f"tenant {name!r} is defined twice")
        keys = [key for t in self.tenants for key in t.keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key belongs to two tenants")   # never echo a key
        if any(not key.strip() or key != key.strip() for key in keys):
            raise ValueError("an API key is blank or has surrounding whitespace")
        for tenant in self.tenants:
            if not low <= tenant.priority <= high:
                raise ValueError(f"tenant {tenant.name!r}: priority {tenant.priority} is outside "
                                 f"priority_range [{low}, {high}]")
        for name, priority in self.objectives.items():
            if not low <= priority <= high:
                raise ValueError(f"objective {name!r}: priority {priority} is outside priority_range [{low}, {high}]")
        return self

    def by_name(self) -> dict[str, TenantSpec]:
        return {tenant.name: tenant for tenant in self.tenants}


def load_tenants(path: str | Path) -> TenantTable:
    """Read a tenant file (YAML or JSON); ValueError with a message that never holds a key."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read it ({type(error).__name__})") from None
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        where = getattr(error, "problem_mark", None) or getattr(error, "lineno", None)
        raise ValueError(f"{path}: not valid YAML/JSON (near {where})") from None
    if isinstance(data, list):
        data = {"tenants": data}
    try:
        return TenantTable.model_validate(data if data is not None else {},
                                          context={"base": Path(path).parent})
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "keys") or "file"
        raise ValueError(f"{path}: {where}: {first['msg'].removeprefix('Value error, ')}") from None


def tenancy_enabled(args: argparse.Namespace) -> bool:
    return bool(args.tenants_file) or bool(args.trust_tenant_header)


@dataclass(frozen=True)
class Identity:
    """Whose request it is: `name` feeds fair scheduling and quotas, `label` the metrics
    (bounded: the table's names, a few header-named tenants, then "other")."""

    name: str
    label: str
    priority: int                 # default of its requests
    best_priority: int            # the lowest (best) value its requests may ask for
    quotas: Quotas = field(default_factory=Quotas)
    header_priority: int | None = None   # the trusted gateway's objective, if it sent one


class TenantResolver:
    """Maps an API key (by its index among `keys()`) and the request's headers to an Identity."""

    def __init__(self, table: TenantTable | None, trust_header: bool) -> None:
        self.trust_header = trust_header
        self._header_labels: set[str] = set()
        self._lock = threading.Lock()
        self.update(table)

    def update(self, table: TenantTable | None) -> None:
        """Use a new table (the key files changed); `keys()` then lists its keys."""
        self.table = table or TenantTable()
        self.tenants = self.table.by_name()
        self._key_owner = [t for t in self.table.tenants for _ in t.keys]

    def keys(self) -> list[str]:
        return [key for t in self.table.tenants for key in t.keys]

    def label(self, name: str) -> str:
        if name == ANONYMOUS:
            return UNKNOWN_LABEL
        if name in self.tenants:
            return name
        with self._lock:
            if name in self._header_labels or len(self._header_labels) < MAX_HEADER_LABELS:
                self._header_labels.add(name)
                return name
        return OTHER_LABEL

    def identify(self, key_index: int | None, headers: Mapping[str, str]) -> Identity:
        """`key_index`: which of `keys()` the request carried (None: no table key)."""
        low, high = self.table.priority_range
        named = self._header(headers, FAIRNESS_HEADERS) if self.trust_header else None
        header_priority = self._objective(headers) if self.trust_header else None
        if named is not None and not _HEADER_TENANT.match(named):
            raise TenantError(f"{FAIRNESS_HEADERS[0]}: a tenant id is 1-128 printable ASCII characters "
                              "without spaces", FAIRNESS_HEADERS[0])
        owner = self._key_owner[key_index] if key_index is not None and key_index < len(self._key_owner) else None
        if named is not None and named in self.tenants:
            owner = self.tenants[named]
        if owner is not None:
            return Identity(owner.name, owner.name, owner.priority, owner.priority, owner.quotas, header_priority)
        if named is not None:   # named by the trusted gateway, not in the table: the gateway's word
            return Identity(named, self.label(named), 0 if low <= 0 <= high else low, low,
                            header_priority=header_priority)
        default = min(max(0, low), high)
        return Identity(ANONYMOUS, UNKNOWN_LABEL, default, default, header_priority=header_priority)

    @staticmethod
    def _header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
        for name in names:
            value = headers.get(name)
            if value is not None and value.strip():
                return value.strip()
        return None

    def _objective(self, headers: Mapping[str, str]) -> int | None:
        value = self._header(headers, OBJECTIVE_HEADERS)
        if value is None:
            return None
        if value in self.table.objectives:
            return self.table.objectives[value]
        try:
            return int(value)
        except ValueError:
            known = ", ".join(sorted(self.table.objectives)) or "none configured"
            raise TenantError(f"{OBJECTIVE_HEADERS[0]}: {value[:64]!r} is neither an integer priority nor "
                              f"a known objective ({known})", OBJECTIVE_HEADERS[0]) from None

    def priority(self, identity: Identity, requested: int | None) -> int:
        """The request's priority: the gateway's objective, else the request's `priority`
        field, else the tenant's; TenantError when outside [tenant's best, range max]."""
        low, high = identity.best_priority, self.table.priority_range[1]
        if identity.header_priority is not None:
            chosen, param = identity.header_priority, OBJECTIVE_HEADERS[0]
            low = self.table.priority_range[0]   # the trusted gateway may use the whole range
        elif requested is not None:
            chosen, param = requested, "priority"
        else:
            return identity.priority
        if not low <= chosen <= high:
            who = f"tenant {identity.name!r}" if identity.name else "requests without a tenant"
            raise TenantError(f"{param}: {chosen} is out of range for {who}: allowed {low} to {high} "
                              "(lower is served first)", param)
        return chosen


class TokenBucket:
    """A per-minute quota spread evenly (as OpenAI enforces its per-minute limits): the level
    refills at quota/60 per second up to one second's worth, and a request is admitted while
    the level is above zero; its cost may take the level below zero (a debt the refill repays),
    so over any window the admitted amount is the quota's share plus at most one second's worth
    and one request."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = self.rate   # one second's worth
        self.level, self.stamp = self.capacity, now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)

    def wait_seconds(self, now: float) -> float:
        """0 when a request may be admitted now, else how long until it may."""
        self._refill(now)
        return 0.0 if self.level > 0 else (-self.level) / self.rate + 1e-3

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Refusal:
    """Why a request was refused: the limit's name, its value and when to retry."""

    limit: str          # "requests_per_minute" or "tokens_per_minute"
    value: int
    retry_after: float
    tenant: str

    @property
    def message(self) -> str:
        unit = "requests" if self.limit == "requests_per_minute" else "tokens"
        return (f"Rate limit reached for tenant {self.tenant!r} on {unit} per minute: limit {self.value}. "
                f"Please try again in {math.ceil(self.retry_after)}s.")

    def headers(self) -> dict[str, str]:
        """Retry-After and OpenAI's x-ratelimit-* headers for the limit that refused."""
        unit = "requests" if self.limit == "requests_per_minute" else "tokens"
        return {"Retry-After": str(max(1, math.ceil(self.retry_after))),
                f"x-ratelimit-limit-{unit}": str(self.value),
                f"x-ratelimit-remaining-{unit}": "0",
                f"x-ratelimit-reset-{unit}": f"{self.retry_after:.3f}s",
                "x-kubeinfer-rate-limit": self.limit}


class RateLimiter:
    """Per-tenant request and token buckets. `share` divides every quota (a router replica
    enforces quota / replicas). Tokens are reserved at admission (prompt + the most the
    request may generate) and the unused part is given back when it finishes."""

    def __init__(self, table: TenantTable, share: float = 1.0, clock=time.monotonic) -> None:
        self.clock, self._lock, self.share = clock, threading.Lock(), share
        self.requests: dict[str, TokenBucket] = {}
        self.tokens: dict[str, TokenBucket] = {}
        self.limits: dict[str, Quotas] = {}
        self.update(table)

    def update(self, table: TenantTable) -> None:
        """Use a new table's quotas: a tenant whose quota is unchanged keeps its bucket (and
        what it owes), a changed quota starts a full bucket, a removed one is gone."""
        with self._lock:
            now = self.clock()

            def buckets(limit: str, current: dict[str, TokenBucket]) -> dict[str, TokenBucket]:
                return {t.name: current[t.name] if getattr(self.limits.get(t.name), limit, None) == quota
                        else TokenBucket(quota * self.share, now)
                        for t in table.tenants if (quota := getattr(t.quotas, limit))}

            self.requests = buckets("requests_per_minute", self.requests)
            self.tokens = buckets("tokens_per_minute", self.tokens)
            self.limits = {t.name: t.quotas for t in table.tenants}

    def check(self, tenant: str) -> Refusal | None:
        """A refusal when either bucket of `tenant` is empty; else take one request."""
        with self._lock:
            now = self.clock()
            for limit, buckets in (("requests_per_minute", self.requests), ("tokens_per_minute", self.tokens)):
                bucket = buckets.get(tenant)
                wait = bucket.wait_seconds(now) if bucket is not None else 0.0
                if wait > 0:
                    return Refusal(limit, getattr(self.limits[tenant], limit), wait, tenant)
            if tenant in self.requests:
                self.requests[tenant].take(1, now)
            return None

    def reserve(self, tenant: str, tokens: int) -> None:
        bucket = self.tokens.get(tenant)
        if bucket is not None:
            with self._lock:
                bucket.take(tokens, self.clock())

    def refund(self, tenant: str, tokens: int) -> None:
        bucket = self.tokens.get(tenant)
        if bucket is not None and tokens > 0:
            with self._lock:
                bucket.give_back(tokens, self.clock())
