"""Talks to the engines for `adapters.py`: reads each Ready pod's adapters and applies the plan.

vLLM's runtime API, on the engines' admin port (no Service exposes it, and it takes no API key,
so spec.auth needs no Secret read here): `GET /v1/models` (adapters carry a `parent`),
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}`. Pods are handled
concurrently; one pod's failure never stops the others. A pod counts once its engine answers
(ContainersReady), before it is Ready: its Ready waits for the adapters (a readiness gate).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import httpx

from kubeinfer.server.kube.pods import pod_targets
from .adapters import MAX_MESSAGE, Action, AdapterReport, PodAdapters, engine_adapters, plan, serving
from .metrics import ADAPTER_OPERATIONS
from .model_source import adapter_path
from .resource import InferenceService

log = logging.getLogger(__name__)
MODELS_TIMEOUT = 5.0
LOAD_TIMEOUT = 120.0  # reading an adapter's safetensors from a network volume can take a while
# vLLM's answer to loading a name it already holds: the goal is reached.
ALREADY_LOADED = "has already been loaded"


def error_message(response: httpx.Response) -> str:
    """The engine's own words: OpenAI's `{"error": {"message"}}`, vLLM's older flat
    `{"message"}`, else the body as text."""
    try:
        data = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:MAX_MESSAGE]}".strip()
    if isinstance(data, dict):
        inner = data.get("error")
        message = inner.get("message") if isinstance(inner, dict) else data.get("message")
        if message:
            return f"HTTP {response.status_code}: {message}"
    return f"HTTP {response.status_code}: {response.text[:MAX_MESSAGE]}"



class AdapterSync:
    """Brings each Ready engine pod's adapters in line with the spec, concurrently across pods."""

    def __init__(self, client: httpx.Client | None = None, max_workers: int = 8) -> None:
        self.client = client or httpx.Client()
        self.max_workers = max_workers
        # per InferenceService uid: (pod, adapter) -> its failure at the last sync, logged then
        self._reported: dict[str, dict[tuple[str, str], str]] = {}

    def sync(self, isvc: InferenceService, pods: Iterable[Mapping[str, Any]]) -> AdapterReport:
        desired = {a.name: adapter_path(isvc, a) for a in isvc.spec.adapters}
        pods = list(pods)
        up = {pod["metadata"]["name"] for pod in pods if serving(pod)}
        targets = sorted((t for t in pod_targets(pods, path="", port_name="admin")
                          if t.name in up and not t.terminating),
                         key=lambda t: t.name)
        reported, failed = self._reported.get(isvc.uid, {}), {}
        if not targets:
            return AdapterReport([])
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(targets))) as pool:
            done = list(pool.map(lambda t: self._one(t.name, t.url, desired, reported, failed), targets))
        self._reported[isvc.uid] = failed
        return AdapterReport(done)

    def forget(self, uid: str) -> None:
        """The InferenceService `uid` was deleted: its logged failures go with it."""
        self._reported.pop(uid, None)

    def _one(self, pod: str, url: str | None, desired: Mapping[str, str],
             reported: Mapping[tuple[str, str], str], failed: dict[tuple[str, str], str]) -> PodAdapters:
        """One pod: read, plan, apply. `reported`: failures logged at the last sync (a retry that
        fails the same way logs at debug); this sync's go into `failed`."""
        result = PodAdapters(pod)
        if url is None:
            result.unreachable = "Ready pod has no IP"
            return result
        try:
            response = self.client.get(f"{url}/v1/models", timeout=MODELS_TIMEOUT)
            if response.status_code != 200:
                result.unreachable = f"GET /v1/models: {error_message(response)}"
                return result
            held = engine_adapters(response.json())
        except (httpx.HTTPError, ValueError) as error:
            result.unreachable = f"GET /v1/models: {error or type(error).__name__}"
            return result
        result.held = set(held)
        for action in plan(desired, held):
            if action.name in result.failures:  # its unload failed: do not load over it
                continue
            try:
                failure = self._apply(url, action)
            except httpx.HTTPError as error:
                failure = f"{type(error).__name__}: {error}"
            ADAPTER_OPERATIONS.labels(action.kind, "ok" if failure is None else "error").inc()
            if failure is not None:
                result.failures[action.name] = failure
                # every reconcile retries: say it once per distinct failure, then quietly
                level = logging.DEBUG if reported.get((pod, action.name)) == failure else logging.WARNING
                failed[(pod, action.name)] = failure
                log.log(level, "%s of adapter %s in pod %s failed: %s", action.kind, action.name, pod, failure)
                continue
            result.done.append(action)
            if action.kind == "load":
                result.held.add(action.name)
            else:
                result.held.discard(action.name)
        return result

    def _apply(self, url: str, action: Action) -> str | None:
        """None when the engine holds (or no longer holds) the adapter as asked, else its error."""
        if action.kind == "load":
            response = self.client.post(f"{url}/v1/load_lora_adapter", timeout=LOAD_TIMEOUT,
                                        json={"lora_name": action.name, "lora_path": action.path})
            if response.status_code == 200 or ALREADY_LOADED in response.text:
                return None
        else:
            response = self.client.post(f"{url}/v1/unload_lora_adapter", timeout=MODELS_TIMEOUT,
                                        json={"lora_name": action.name})
            if response.status_code in (200, 404):  # 404: already gone
                return None
        return error_message(response)


