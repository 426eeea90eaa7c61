"""The per-InferenceService secret that keys the block hashes its engines publish and its routers
recompute (`kubeinfer.server.engine.kv_events`), so a digest that leaves a pod tells nobody
without it whether a guessed prompt is cached.

The operator creates the Secret once, with a random value, and never reads it back: its RBAC
holds `create` on Secrets and no `get`. Engines and routers receive it as an env var from the
kubelet. Deleting the Secret makes the next reconcile create a new one; pods started after that
get the new key (the chart documents rolling the service then).
"""

from __future__ import annotations

import secrets
from typing import Any

from kubeinfer.server.flags import ENGINE_FLAGS
from .resource import InferenceService

SECRET_KEY = "kv-hash-key"
ENV = next(flag.env for flag in ENGINE_FLAGS if flag.dest == "kv_hash_key")


def secret_name(isvc: InferenceService) -> str:
    return f"{isvc.name}-kv-hash-key"


def new_secret(isvc: InferenceService) -> dict[str, Any]:
    """The Secret with a fresh 256-bit value, owned by the InferenceService (deleted with it)."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": isvc.metadata(secret_name(isvc)),
            "type": "Opaque", "immutable": True, "stringData": {SECRET_KEY: secrets.token_urlsafe(32)}}


def env(isvc: InferenceService) -> tuple[str, dict[str, Any]]:
    """The env var engines and routers read the key from."""
    return ENV, {"valueFrom": {"secretKeyRef": {"name": secret_name(isvc), "key": SECRET_KEY}}}
