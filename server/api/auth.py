"""Bearer API keys, checked in constant time; probes and /metrics stay open for the kubelet
and Prometheus, like vLLM which guards only the API routes."""

from __future__ import annotations

import argparse
import hmac
from pathlib import Path

from fastapi import Request

from ..flags import parse_api_keys
from .error_body import OpenAIError

# Routes that never need a key: the kubelet's probes and Prometheus cannot send one, routers
# read the cache and tokenizer routes (hashes and a public tokenizer, never prompts), and
# /version and /openapi.json reveal nothing a key protects. Proxies in front of the engine
# (the scale-from-zero gateway) leave the same paths open.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/openapi.json",
                        "/kv/blocks", "/tokenizer_info"})


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """`--api-keys` plus the keys in `--api-keys-file`, for the CLIs.

    Exits with a message (never a key) when the file cannot be read or holds no key, or when
    `--require-api-key` is set and no key is configured at all: a service meant to be
    protected must not come up open.
    """
    keys = list(args.api_keys)
    if args.api_keys_file:
        try:
            file_keys = parse_api_keys(Path(args.api_keys_file).read_text())
        except (OSError, UnicodeDecodeError) as error:
            raise SystemExit(f"--api-keys-file {args.api_keys_file}: cannot read it "
                             f"({type(error).__name__})") from None
        if not file_keys:
            raise SystemExit(f"--api-keys-file {args.api_keys_file} holds no API key")
        keys += file_keys
    if args.require_api_key and not keys:
        raise SystemExit("--require-api-key is set but no API key is configured "
                         "(--api-keys, KUBEINFER_API_KEYS or --api-keys-file)")
    return keys


class ApiKeyCheck:
    """FastAPI dependency: refuses with 401 unless the request carries one of `keys`."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = [key.encode() for key in keys]

    async def __call__(self, request: Request) -> None:
        self.matched(request)

    def matched(self, request: Request) -> int | None:
        """The index of the key the request carries (None when no key is configured); 401 otherwise."""
        if not self.keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
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
