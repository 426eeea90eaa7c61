"""Engine pods as the API returns them (JSON dicts) -> where to reach each, and whether it is Ready.

The autoscaler scrapes these targets, the router sends requests to them and the operator
loads adapters on them: one reading of a pod's IP, port and Ready condition for all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

DEFAULT_PORT = 8000  # `kubeinfer serve --port` default, used when the pod names no port


@dataclass(frozen=True)
class PodTarget:
    """What the autoscaler needs from one pod object."""

    name: str
    url: str | None  # http://ip:port/metrics, None before the pod has an IP
    ready: bool
    terminating: bool


def pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def pod_targets(pods: Iterable[Mapping[str, Any]], path: str = "/metrics",
                port_name: str = "http") -> list[PodTarget]:
    """Pods as returned by the API (JSON dicts) -> targets on the container port `port_name`."""
    targets = []
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        url = f"http://{ip}:{_port(pod, port_name)}{path}" if ip else None
        targets.append(PodTarget(pod["metadata"]["name"], url, pod_ready(pod),
                                 bool(pod["metadata"].get("deletionTimestamp"))))
    return targets


def _port(pod: Mapping[str, Any], name: str) -> int:
    """The container port named `name`, else the first one declared (a pod of an older operator
    has no admin port: its API port serves the admin routes)."""
    ports = [p for c in pod.get("spec", {}).get("containers", []) for p in c.get("ports") or []]
    named = [p for p in ports if p.get("name") == name]
    return int((named or ports or [{"containerPort": DEFAULT_PORT}])[0]["containerPort"])
