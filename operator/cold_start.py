"""Where an engine pod's start went, read from its status (pure): the fetch init container's
run (waiting for the node cache's lock, downloading), then the engine's start to first Ready.
The fetch's own report (bytes downloaded, seconds waiting for the lock and downloading, the
revision it found, what a budget evicted) is its termination message, a JSON object
(`kubeinfer fetch` writes it): the kubelet keeps it in the init container's status, so no log
access is needed.

Each pod is reported once, when it first turns Ready after the last one reported
(`status.model.lastColdStart`), as an Event and in the `kubeinfer:` histograms below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import Counter, Histogram

from . import api
from .status import ColdStart

_BUCKETS = (0.5, 1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 1800)
FETCH_SECONDS = Histogram("kubeinfer:model_fetch_seconds", "An engine pod's fetch-model init container: "
                          "waiting for the node cache's lock and downloading.", ["namespace", "inferenceservice"],
                          buckets=_BUCKETS)
LOAD_SECONDS = Histogram("kubeinfer:engine_load_seconds", "An engine pod's engine start to first Ready.",
                         ["namespace", "inferenceservice"], buckets=_BUCKETS)
CACHE_WAIT_SECONDS = Histogram("kubeinfer:model_cache_wait_seconds", "An engine pod's fetch-model: waiting for "
                               "another pod's download of the same weights on its node (the cache's lock).",
                               ["namespace", "inferenceservice"], buckets=_BUCKETS)
DOWNLOAD_SECONDS = Histogram("kubeinfer:model_download_seconds", "An engine pod's fetch-model: its own download "
                             "(0 when the node's cache had the weights).", ["namespace", "inferenceservice"],
                             buckets=_BUCKETS)
DOWNLOAD_BYTES = Counter("kubeinfer:model_download_bytes", "Bytes engine pods' fetch-model containers downloaded "
                         "into their nodes' caches.", ["namespace", "inferenceservice"])
COLD_START_SECONDS = Histogram("kubeinfer:cold_start_seconds", "An engine pod's creation to first Ready.",
                               ["namespace", "inferenceservice"], buckets=_BUCKETS)


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


@dataclass(frozen=True)
class FetchReport:
    """What a finished fetch-model container said about its run."""

    revision: str | None = None
    bytes_downloaded: int | None = None
    lock_wait_seconds: float | None = None
    download_seconds: float | None = None
    evicted: tuple[str, ...] = ()


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def fetch_report(pod: dict[str, Any]) -> FetchReport:
    """The pod's fetch-model termination message, read defensively (it is the container's word)."""
    status = pod.get("status") or {}
    fetch = next((c for c in status.get("initContainerStatuses") or [] if c.get("name") == api.FETCH_CONTAINER), {})
    done = (fetch.get("state") or {}).get("terminated") or {}
    try:
        report = json.loads(done.get("message") or "")
    except ValueError:
        return FetchReport()
    if done.get("exitCode") != 0 or not isinstance(report, dict):
        return FetchReport()
    revision = report.get("revision")
    downloaded = _number(report.get("bytes_downloaded"))
    evicted = report.get("evicted") if isinstance(report.get("evicted"), list) else []
    return FetchReport(revision=revision if isinstance(revision, str) and len(revision) <= 64 else None,
                       bytes_downloaded=int(downloaded) if downloaded is not None else None,
                       lock_wait_seconds=_number(report.get("lock_wait_seconds")),
                       download_seconds=_number(report.get("download_seconds")),
                       evicted=tuple(e for e in evicted if isinstance(e, str)))


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
    report = fetch_report(pod)
    return ColdStart(pod=pod["metadata"]["name"], node=(pod.get("spec") or {}).get("nodeName"), ready_time=ready,
                     fetch_seconds=fetch_seconds, cache_wait_seconds=report.lock_wait_seconds,
                     download_seconds=report.download_seconds, bytes_downloaded=report.bytes_downloaded,
                     revision=report.revision, load_seconds=max(0.0, (ready - started).total_seconds()),
                     total_seconds=max(0.0, (ready - created).total_seconds()))


def new_cold_starts(pods: list[dict[str, Any]], last: ColdStart | None) -> list[ColdStart]:
    """Pods that turned Ready after the last one reported, oldest first."""
    found = [c for pod in pods if (c := cold_start(pod)) is not None]
    return sorted((c for c in found if last is None or c.ready_time > last.ready_time), key=lambda c: c.ready_time)


def _fetch_parts(start: ColdStart) -> str:
    """(cache wait 3 s, downloaded 2.15 GB in 55 s) when the fetch reported them."""
    parts = []
    if start.cache_wait_seconds is not None:
        parts.append(f"cache wait {start.cache_wait_seconds:.0f} s")
    if start.bytes_downloaded is not None:
        parts.append(f"downloaded {start.bytes_downloaded / 1e9:.2f} GB in {start.download_seconds or 0:.0f} s"
                     if start.bytes_downloaded else "nothing downloaded")
    return f" ({', '.join(parts)})" if parts else ""


def describe(start: ColdStart) -> str:
    fetch = f"fetch {start.fetch_seconds:.0f} s{_fetch_parts(start)}, " if start.fetch_seconds is not None else ""
    return (f"pod {start.pod} on {start.node}: {fetch}engine load {start.load_seconds:.0f} s, "
            f"Ready {start.total_seconds:.0f} s after creation")


def observe_metrics(namespace: str, name: str, start: ColdStart) -> None:
    if start.fetch_seconds is not None:
        FETCH_SECONDS.labels(namespace, name).observe(start.fetch_seconds)
    if start.cache_wait_seconds is not None:
        CACHE_WAIT_SECONDS.labels(namespace, name).observe(start.cache_wait_seconds)
    if start.download_seconds is not None:
        DOWNLOAD_SECONDS.labels(namespace, name).observe(start.download_seconds)
    if start.bytes_downloaded is not None:
        DOWNLOAD_BYTES.labels(namespace, name).inc(start.bytes_downloaded)
    LOAD_SECONDS.labels(namespace, name).observe(start.load_seconds)
    COLD_START_SECONDS.labels(namespace, name).observe(start.total_seconds)
