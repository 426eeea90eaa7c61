"""API keys and the tenant table, re-read from their files while serving.

A Kubernetes Secret mounted as a volume (not through `subPath`) is updated in place by the
kubelet when the Secret changes, so `--api-keys-file`, `--tenants-file` and the tenants'
`keys_file`s follow a key rotation without a restart: every process that checks keys (engines,
routers, the endpoint picker) looks at the files again at most every `--key-reload-seconds`,
on the path of the request that finds the interval over (a few small reads, no thread, and the
swap happens between two requests' checks, so a key's index and its tenant never disagree).

A new version is applied whole or not at all: one that does not parse, or leaves a service that
must be protected without a key, is refused with a warning and a count, and the keys in force
stay. Requests already admitted keep running under the keys they were admitted with.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from .flags import parse_api_keys
from .tenancy import TenantTable, load_tenants

logger = logging.getLogger("kubeinfer.credentials")
READ_TRIES = 4   # reads of files that keep changing before the last one read is taken


@dataclass(frozen=True)
class Credentials:
    """What requests are checked against: every accepted key outside the tenant table
    (`--api-keys` and `--api-keys-file`), and the table (with its tenants' keys), if any."""

    api_keys: list[str]
    table: TenantTable | None


def read_api_keys_file(path: str | Path) -> list[str]:
    """The keys of an `--api-keys-file`; ValueError naming the file (never a key) when it cannot
    be read or holds none."""
    try:
        keys = parse_api_keys(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-keys-file {path}: cannot read it ({type(error).__name__})") from None
    if not keys:
        raise ValueError(f"--api-keys-file {path} holds no API key")
    return keys


class CredentialFiles:
    """The key and tenant files of one process, and who to tell when they change.

    `apply` callbacks (`subscribe`) receive each accepted version; `refresh` is called before
    each key check and looks at the files when `interval` seconds have passed (0: never)."""

    def __init__(self, static_keys: list[str], api_keys_file: str | None, tenants_file: str | None,
                 require_key: bool = False, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.static_keys = list(static_keys)
        self.api_keys_file, self.tenants_file = api_keys_file, tenants_file
        self.require_key, self.interval, self.clock = require_key, interval, clock
        self._subscribers: list[Callable[[Credentials], None]] = []
        self._reloads: Counter | None = None
        self._seen = b""       # the fingerprint of the files when last looked at
        self._due = clock() + interval
        self.current = self._load()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CredentialFiles":
        """The CLI's files (`--api-keys`, `--api-keys-file`, `--tenants-file`); exits with a
        message (never a key) when they are unusable at startup."""
        try:
            return cls(list(args.api_keys), args.api_keys_file, args.tenants_file, args.require_api_key,
                       args.key_reload_seconds)
        except ValueError as error:
            raise SystemExit(str(error)) from None

    def subscribe(self, apply: Callable[[Credentials], None]) -> None:
        self._subscribers.append(apply)

    def count_reloads(self, registry: CollectorRegistry) -> None:
        """Export `kubeinfer:credential_reloads_total{outcome="applied"|"refused"}` in `registry`."""
        self._reloads = Counter("kubeinfer:credential_reloads",
                                "Changes of the API-key and tenant files, applied or refused (the keys "
                                "in force then stay).", ["outcome"], registry=registry)
        for outcome in ("applied", "refused"):
            self._reloads.labels(outcome)

    def refresh(self) -> None:
        """Apply the files' new version if the interval is over and they changed."""
        if not self.interval or self.clock() < self._due:
            return
        self._due = self.clock() + self.interval
        seen = self._fingerprint(self.current.table)
        if seen == self._seen:
            return
        try:
            credentials = self._load()
        except ValueError as error:
            self._seen = seen   # warned once per version of the files
            self._count("refused")
            logger.warning("key files changed but were not applied, the keys in force stay: %s", error)
            return
        self.current = credentials
        for apply in self._subscribers:
            apply(credentials)
        self._count("applied")
        logger.info("key files changed: %d API keys, %d tenants in force", len(credentials.api_keys),
                    len(credentials.table.tenants) if credentials.table else 0)

    def _count(self, outcome: str) -> None:
        if self._reloads is not None:
            self._reloads.labels(outcome).inc()

    def _load(self) -> Credentials:
        """Read every file; ValueError naming what is wrong. Read twice around the fingerprint
        (a new table can name new key files), so a change during the read shows at the next
        refresh instead of hiding behind a fingerprint taken after it."""
        previous = self._parse()
        for _ in range(READ_TRIES):
            self._seen = self._fingerprint(previous.table)
            credentials = self._parse()
            if credentials == previous:
                break
            previous = credentials
        return credentials

    def _parse(self) -> Credentials:
        keys = [*self.static_keys, *(read_api_keys_file(self.api_keys_file) if self.api_keys_file else [])]
        table = None
        if self.tenants_file:
            try:
                table = load_tenants(self.tenants_file)
            except ValueError as error:
                raise ValueError(f"--tenants-file {error}") from None
        if self.require_key and not keys:
            raise ValueError("--require-api-key is set but no API key is configured "
                             "(--api-keys, KUBEINFER_API_KEYS or --api-keys-file)")
        return Credentials(keys, table)

    def _fingerprint(self, table: TenantTable | None) -> bytes:
        """A digest of every watched file's bytes: the key files and the table's tenants' key files."""
        paths = [Path(p) for p in (self.api_keys_file, self.tenants_file) if p]
        if self.tenants_file and table is not None:
            base = Path(self.tenants_file).parent
            paths += [base / t.keys_file for t in table.tenants if t.keys_file]
        digest = hashlib.sha256()
        for path in paths:
            try:
                digest.update(hashlib.sha256(path.read_bytes()).digest())
            except OSError as error:
                digest.update(type(error).__name__.encode())
        return digest.digest()
