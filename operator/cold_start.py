"""Where an engine pod's start went, read from its status (pure): the fetch init container's
run (waiting for the node cache's lock, downloading), then the engine's start to first Ready.

Each pod is reported once, when it first turns Ready after the last one reported
(`status.model.lastColdStart`), as an Event and in the `kubeinfer:` histograms below.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prometheus_client import Histogram

from . import api
from .status import ColdStart

_BUCKETS = (0.5, 1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 1800)
FETCH_SECONDS = Histogram("kubeinfer:model_fetch_seconds", "An engine pod's fetch-model init container: "
                          "waiting for the node cache's lock and downloading.", ["namespace", "inferenceservice"],
                          buckets=_BUCKETS)
LOAD_SECONDS = Histogram("kubeinfer:engine_load_seconds", "An engine pod's engine start to first Ready.",
                         ["namespace", "inferenceservice"], buckets=_BUCKETS)
COLD_START_SECONDS = Histogram("kubeinfer:cold_start_seconds", "An engine pod's creation to first Ready.",
                               ["namespace", "inferenceservice"], buckets=_BUCKETS)


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def cold_start(pod: dict[str, Any]) -> ColdStart | None:
    """The pod's start, if it is Ready and its engine container is running."""
    status = pod.get("status") or {}
    ready = next((_time(c.get("lastTransitionTime")) for c in status.get("conditions") or []
                  if c.get("type") == "Ready" and c.get("status") == "True"), None)
    engine = next((c for c in status.get("containerStatuses") or [] if c.get("name") == api.ENGINE_CONTAINER), {})
    started = _time(((engine.get("state") or {}).get("running") or {}).get("startedAt"))
    created = _time(pod["metadata"].get("creationTimestamp"))
    if ready is None or started is None or created is None:
        return None
    fetch = next((c for c in status.get("initContainerStatuses") or [] if c.get("name") == api.FETCH_CONTAINER), {})
    done = (fetch.get("state") or {}).get("terminated") or {}
    fetch_seconds = None
    if done.get("startedAt") and done.get("finishedAt"):
        fetch_seconds = (_time(done["finishedAt"]) - _time(done["startedAt"])).total_seconds()
    return ColdStart(pod=pod["metadata"]["name"], node=(pod.get("spec") or {}).get("nodeName"), ready_time=ready,
                     fetch_seconds=fetch_seconds, load_seconds=max(0.0, (ready - started).total_seconds()),
                     total_seconds=max(0.0, (ready - created).total_seconds()))


def new_cold_starts(pods: list[dict[str, Any]], last: ColdStart | None) -> list[ColdStart]:
    """Pods that turned Ready after the last one reported, oldest first."""
    found = [c for pod in pods if (c := cold_start(pod)) is not None]
    return sorted((c for c in found if last is None or c.ready_time > last.ready_time), key=lambda c: c.ready_time)


def describe(start: ColdStart) -> str:
    fetch = f"fetch {start.fetch_seconds:.0f} s, " if start.fetch_seconds is not None else ""
    return (f"pod {start.pod} on {start.node}: {fetch}engine load {start.load_seconds:.0f} s, "
            f"Ready {start.total_seconds:.0f} s after creation")


def observe_metrics(namespace: str, name: str, start: ColdStart) -> None:
    if start.fetch_seconds is not None:
        FETCH_SECONDS.labels(namespace, name).observe(start.fetch_seconds)
    LOAD_SECONDS.labels(namespace, name).observe(start.load_seconds)
    COLD_START_SECONDS.labels(namespace, name).observe(start.total_seconds)
