"""Where the gateway's engine pods are, and how it asks for one when there is none.

`Backends` is the gateway's whole view of Kubernetes, so unit tests drive it with a fake that
"starts a pod" and e2e runs `KubeBackends` against the API server; `StaticBackends` is the
standalone router's fixed list of engines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Protocol

import httpx

from ..kube.scale import Conflict, ScaleApi, engine_selector
from ..kube.pods import pod_targets

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


class PodWatch:
    """The pods matching a selector, kept current by list + watch on a daemon thread (the
    Kubernetes client is synchronous). A watch that ends is resumed from its last
    resourceVersion; a 410 Gone (that version was compacted away) or an error lists again."""

    def __init__(self, namespace: str, selector: str, api_client: Any = None,
                 watch_seconds: int = 300) -> None:
        self.namespace, self.selector, self.watch_seconds = namespace, selector, watch_seconds
        self.api_client = api_client
        self.synced = threading.Event()
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kubeinfer-pod-watch", daemon=True)

    def start(self) -> "PodWatch":
        self._thread.start()
        return self

    def pods(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pods.values())

    def _run(self) -> None:
        from kubernetes import client, watch

        core = client.CoreV1Api(self.api_client)
        while True:
            try:
                listed = core.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                                  _preload_content=False)
                body = json.loads(listed.data)
                with self._lock:
                    self._pods = {pod["metadata"]["name"]: pod for pod in body.get("items", [])}
                self.synced.set()
                self._watch(core, watch.Watch(), body["metadata"]["resourceVersion"])
            except client.ApiException as error:
                if error.status != 410:
                    log.warning("watching pods %s: %s", self.selector, error.reason)
                    time.sleep(1.0)
            except Exception as error:  # noqa: BLE001 - the watch must outlive API outages
                log.warning("watching pods %s: %s", self.selector, error)
                time.sleep(1.0)

    def _watch(self, core: Any, stream: Any, version: str) -> None:
        while True:   # each stream ends after watch_seconds; the next resumes where it stopped
            for event in stream.stream(core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                       resource_version=version, timeout_seconds=self.watch_seconds,
                                       allow_watch_bookmarks=True, deserialize=False):
                pod = event["object"]
                if event["type"] == "BOOKMARK":
                    continue
                with self._lock:
                    if event["type"] == "DELETED":
                        self._pods.pop(pod["metadata"]["name"], None)
                    else:
                        self._pods[pod["metadata"]["name"]] = pod
            version = stream.resource_version or version


class KubeBackends:
    """The InferenceService's engine pods, from a `PodWatch` started on first use (the
    InferenceService is read once for its selector)."""

    def __init__(self, kube: ScaleApi, namespace: str, name: str, api_client: Any = None) -> None:
        self.kube, self.namespace, self.name, self.api_client = kube, namespace, name, api_client
        self._watch: PodWatch | None = None
        self._lock = asyncio.Lock()

    async def ready(self) -> list[str]:
        async with self._lock:
            if self._watch is None:
                isvc = await self.kube.get(self.namespace, self.name)
                self._watch = PodWatch(self.namespace, engine_selector(isvc), self.api_client).start()
                await asyncio.to_thread(self._watch.synced.wait, 10.0)
        return sorted(t.url for t in pod_targets(self._watch.pods(), path="")
                      if t.ready and not t.terminating and t.url)

    async def wake(self) -> bool:
        isvc = await self.kube.get(self.namespace, self.name)
        spec = isvc.get("spec") or {}
        if spec.get("replicas", 1) != 0 or (spec.get("autoscaling") or {}).get("minReplicas", 1) != 0:
            return False   # not at zero, or scaled to zero by hand (no scale-from-zero asked)
        try:  # conditional: never overrides a scale someone wrote meanwhile
            await self.kube.set_replicas(self.namespace, self.name, 1,
                                         isvc["metadata"].get("resourceVersion"))
        except Conflict:
            return False
        log.info("%s/%s: scaled 0 -> 1 for a held request", self.namespace, self.name)
        return True

    def forget(self) -> None:
        """Nothing to drop: the watch hears of the pod's end itself."""


class StaticBackends:
    """Engines the user started (`kubeinfer route --backend URL ...`): those whose `/ready`
    (or, without one, `/health`) answered 200 at the last probe, probed at most every `ttl` seconds, in the order given.
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
        """kubeinfer's `/ready`; an engine without one (404: vLLM, SGLang) by its `/health`,
        which those answer 200 once they serve."""
        try:
            answer = await self.client.get(f"{url}/ready", timeout=2.0)
            if answer.status_code == 404:
                answer = await self.client.get(f"{url}/health", timeout=2.0)
            return answer.status_code == 200
        except httpx.HTTPError:
            return False

    async def wake(self) -> bool:
        return False

    def forget(self) -> None:
        self._probed = float("-inf")
