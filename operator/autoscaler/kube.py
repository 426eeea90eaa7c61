"""The few Kubernetes calls the autoscaler and the gateway make, behind one small interface.

`ScaleApi` is what the tick and the gateway depend on, so unit tests pass an in-memory fake
and e2e exercises `KubeScaleApi` against the real API server. The official client is
synchronous; its calls run in a worker thread to keep the kopf event loop free.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from kubeinfer.operator import api


class Conflict(Exception):
    """The object changed since it was read; the caller decides again on fresh state."""


class ScaleApi(Protocol):
    async def get(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    async def set_replicas(self, namespace: str, name: str, replicas: int,
                           resource_version: str | None = None) -> None: ...

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...


def engine_selector(isvc: dict[str, Any]) -> str:
    """The scale subresource's selector (status.selector), else the operator's engine labels."""
    name = isvc["metadata"]["name"]
    return (isvc.get("status") or {}).get("selector") or \
        f"app.kubernetes.io/component=engine,{api.INSTANCE_LABEL}={name}"


class KubeScaleApi:
    """`ScaleApi` over the official client: in-cluster config, else the local kubeconfig."""

    def __init__(self) -> None:
        from kubernetes import client, config  # deferred: unit tests never need a cluster

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self._core, self._custom = client.CoreV1Api(), client.CustomObjectsApi()
        self._errors = client.ApiException

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._custom.get_namespaced_custom_object, api.GROUP,
                                       api.VERSION, namespace, api.PLURAL, name)

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        response = await asyncio.to_thread(self._core.list_namespaced_pod, namespace,
                                           label_selector=selector, _preload_content=False)
        return json.loads(response.data)["items"]

    async def set_replicas(self, namespace: str, name: str, replicas: int,
                           resource_version: str | None = None) -> None:
        """Merge-patch the scale subresource; with a resourceVersion the write is conditional."""
        body: dict[str, Any] = {"spec": {"replicas": replicas}}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        try:
            await asyncio.to_thread(self._custom.patch_namespaced_custom_object_scale, api.GROUP,
                                    api.VERSION, namespace, api.PLURAL, name, body)
        except self._errors as error:
            if error.status == 409:
                raise Conflict(f"{namespace}/{name} changed since it was read") from error
            raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await asyncio.to_thread(self._custom.patch_namespaced_custom_object_status, api.GROUP,
                                api.VERSION, namespace, api.PLURAL, name, {"status": status})
