"""The few Kubernetes calls the autoscaler, the deletion costs and the gateway make, behind one
small interface.

`ScaleApi` is what the tick and the gateway depend on, so unit tests pass an in-memory fake
and e2e exercises `KubeScaleApi` against the real API server. It rides on the operator's own
REST client, which is synchronous, so each call runs in a worker thread to keep the event
loop (kopf's, or the gateway's) free.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from . import api
from .client import Kube, KubeError, load_api_client
from .api import engine_selector_labels, label_selector

MERGE_PATCH = "application/merge-patch+json"


class Conflict(Exception):
    """The object changed since it was read; the caller decides again on fresh state."""


class ScaleApi(Protocol):
    async def get(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def set_replicas(self, namespace: str, name: str, replicas: int,
                           resource_version: str | None = None) -> None: ...

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...

    async def patch_pod(self, namespace: str, name: str, body: dict[str, Any]) -> None: ...


def engine_selector(isvc: dict[str, Any]) -> str:
    """The scale subresource's selector (status.selector), else the operator's engine labels."""
    name = isvc["metadata"]["name"]
    return (isvc.get("status") or {}).get("selector") or \
        label_selector(engine_selector_labels(name))


class KubeScaleApi:
    """`ScaleApi` over `client.Kube` (in-cluster auth, else kubeconfig)."""

    def __init__(self, kube: Kube | None = None) -> None:
        self.kube = kube or Kube(load_api_client())

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        found = await asyncio.to_thread(self.kube.get, api.KIND, namespace, name)
        if found is None:
            raise LookupError(f"{api.KIND} {namespace}/{name} no longer exists")
        return found

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.kube.list, "Pod", namespace, selector)

    async def set_replicas(self, namespace: str, name: str, replicas: int,
                           resource_version: str | None = None) -> None:
        """Merge-patch the scale subresource; with a resourceVersion the write is conditional."""
        body: dict[str, Any] = {"spec": {"replicas": replicas}}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        path = self.kube.path(api.KIND, namespace, name) + "/scale"
        try:
            await asyncio.to_thread(self.kube.request, "PATCH", path, body,
                                    content_type=MERGE_PATCH)
        except KubeError as error:
            if error.status == 409:
                raise Conflict(f"{namespace}/{name} changed since it was read") from error
            raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await asyncio.to_thread(self.kube.patch_status, namespace, name, status)

    async def patch_pod(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        """Merge-patch a pod (the operator's deletion-cost annotation)."""
        await asyncio.to_thread(self.kube.request, "PATCH", self.kube.path("Pod", namespace, name), body,
                                content_type=MERGE_PATCH)
