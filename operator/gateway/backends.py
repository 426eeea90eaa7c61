"""Where the gateway's engine pods are, and how it asks for one when there is none.

`Backends` is the gateway's whole view of Kubernetes, so unit tests drive it with a fake that
"starts a pod" and e2e runs `KubeBackends` against the API server; `StaticBackends` is the
standalone router's fixed list of engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import httpx

from kubeinfer.operator.autoscaler.kube import Conflict, ScaleApi, engine_selector
from kubeinfer.operator.autoscaler.scrape import pod_targets

log = logging.getLogger(__name__)


class Backends(Protocol):
    async def ready(self) -> list[str]:
        """Base URLs (http://ip:port) of Ready engine pods that are not terminating."""
        ...

    async def wake(self) -> bool:
        """Ask for one replica if the service is at zero; True if this call scaled it."""
        ...

    def forget(self) -> None:
        """Drop cached pods (one just refused a connection)."""
        ...


class KubeBackends:
    """Pods listed by the InferenceService's selector, cached briefly for bursts of requests."""

    def __init__(self, kube: ScaleApi, namespace: str, name: str, ttl: float = 1.0) -> None:
        self.kube, self.namespace, self.name, self.ttl = kube, namespace, name, ttl
        self._urls: list[str] = []
        self._fetched = float("-inf")
        self._lock = asyncio.Lock()

    async def ready(self) -> list[str]:
        async with self._lock:  # one API call serves every request arriving meanwhile
            if time.monotonic() - self._fetched >= self.ttl:
                isvc = await self.kube.get(self.namespace, self.name)
                pods = await self.kube.list_pods(self.namespace, engine_selector(isvc))
                self._urls = [t.url for t in pod_targets(pods, path="")
                              if t.ready and not t.terminating and t.url]
                self._fetched = time.monotonic()
            return list(self._urls)

    async def wake(self) -> bool:
        isvc = await self.kube.get(self.namespace, self.name)
        if (isvc.get("spec") or {}).get("replicas", 1) != 0:
            return False
        try:  # conditional: never overrides a scale someone wrote meanwhile
            await self.kube.set_replicas(self.namespace, self.name, 1,
                                         isvc["metadata"].get("resourceVersion"))
        except Conflict:
            return False
        log.info("%s/%s: scaled 0 -> 1 for a held request", self.namespace, self.name)
        return True

    def forget(self) -> None:
        self._fetched = float("-inf")


class StaticBackends:
    """Engines the user started (`kubeinfer route --backend URL ...`): those whose `/ready`
    answered 200 at the last probe, probed at most every `ttl` seconds, in the order given.
    Nothing here can start an engine, so `wake` never scales."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient, ttl: float = 1.0) -> None:
        self.urls, self.client, self.ttl = [u.rstrip("/") for u in urls], client, ttl
        self._ready: list[str] = []
        self._probed = float("-inf")
        self._lock = asyncio.Lock()

    async def ready(self) -> list[str]:
        async with self._lock:
            if time.monotonic() - self._probed >= self.ttl:
                answers = await asyncio.gather(*(self._probe(url) for url in self.urls))
                self._ready = [url for url, ok in zip(self.urls, answers) if ok]
                self._probed = time.monotonic()
            return list(self._ready)

    async def _probe(self, url: str) -> bool:
        try:
            return (await self.client.get(f"{url}/ready", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def wake(self) -> bool:
        return False

    def forget(self) -> None:
        self._probed = float("-inf")
