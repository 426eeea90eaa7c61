"""Read the engine gauges straight from each Ready pod's `/metrics`.

Pods are found by listing them by label (EndpointSlices reject the loopback pod IPs of the
local cluster, and a pod's own Ready condition is what matters here). Scrapes run concurrently
with a short timeout; a failure becomes a sample without gauges, which the decision never reads
as zero load.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..observe import pod_ready
from .decision import PodSample

log = logging.getLogger(__name__)
DEFAULT_PORT = 8000  # `kubeinfer serve --port` default, used when the pod names no port


@dataclass(frozen=True)
class PodTarget:
    """What the autoscaler needs from one pod object."""

    name: str
    url: str | None  # http://ip:port/metrics, None before the pod has an IP
    ready: bool
    terminating: bool


def pod_targets(pods: Iterable[Mapping[str, Any]], path: str = "/metrics") -> list[PodTarget]:
    """Pods as returned by the API (JSON dicts) -> scrape targets."""
    targets = []
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        url = f"http://{ip}:{_port(pod)}{path}" if ip else None
        targets.append(PodTarget(pod["metadata"]["name"], url, pod_ready(pod),
                                 bool(pod["metadata"].get("deletionTimestamp"))))
    return targets


def _port(pod: Mapping[str, Any]) -> int:
    """The container port named `http`, else the first one declared."""
    ports = [p for c in pod.get("spec", {}).get("containers", []) for p in c.get("ports") or []]
    named = [p for p in ports if p.get("name") == "http"]
    return int((named or ports or [{"containerPort": DEFAULT_PORT}])[0]["containerPort"])


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum each wanted metric over its label sets (one pod may serve several model names)."""
    wanted = set(names)
    totals = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] += sample.value
    return totals


async def scrape(client: httpx.AsyncClient, targets: list[PodTarget], names: Iterable[str],
                 timeout: float = 2.0) -> list[PodSample]:
    """One sample per live pod; not-Ready pods are listed but never scraped."""
    wanted = tuple(names)
    live = [t for t in targets if not t.terminating]

    async def one(target: PodTarget) -> PodSample:
        if not target.ready:
            return PodSample(target.name, False)
        try:
            if target.url is None:
                raise ValueError("Ready pod has no IP")
            response = await client.get(target.url, timeout=timeout)
            response.raise_for_status()
            return PodSample(target.name, True, parse_gauges(response.text, wanted))
        except (httpx.HTTPError, ValueError) as error:
            log.warning("scrape of pod %s (%s) failed: %s", target.name, target.url,
                        error or type(error).__name__)
            return PodSample(target.name, True, None)

    return list(await asyncio.gather(*(one(t) for t in live)))
