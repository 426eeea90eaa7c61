"""Read the engine gauges straight from each Ready pod's `/metrics`.

Pods are found by listing them by label (EndpointSlices reject the loopback pod IPs of the
local cluster, and a pod's own Ready condition is what matters here). Scrapes run concurrently
with a short timeout; a failure becomes a sample without gauges, which the decision never reads
as zero load.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.server.kube.pods import PodTarget
from .decision import PodSample

log = logging.getLogger(__name__)


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
