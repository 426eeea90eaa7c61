"""Which pods the local pod runner runs as real processes; the rest stay simulated by kwok.

One rule, two renderings: a Python predicate for the runner and a jq expression for kwok's
stage selectors, so kwok never marks a runner pod Ready before its readiness probe passes.
"""
from __future__ import annotations

import json
import os

SIMULATE_LABEL = "kubeinfer.io/simulate"  # "true": leave this pod to kwok even if it is ours
DEFAULT_PREFIXES = "kubeinfer/,ghcr.io/kubeinfer/,docker.io/kubeinfer/"


def image_prefixes() -> tuple[str, ...]:
    """kubeinfer's own images, from KUBEINFER_RUNNER_IMAGE_PREFIXES (comma-separated)."""
    raw = os.environ.get("KUBEINFER_RUNNER_IMAGE_PREFIXES", DEFAULT_PREFIXES)
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def runner_managed(pod: dict, prefixes: tuple[str, ...] | None = None) -> bool:
    prefixes = prefixes or image_prefixes()
    labels = pod.get("metadata", {}).get("labels") or {}
    images = [c.get("image", "") for c in pod.get("spec", {}).get("containers", [])]
    return labels.get(SIMULATE_LABEL) != "true" and any(i.startswith(prefixes) for i in images)


def runner_managed_jq(prefixes: tuple[str, ...] | None = None) -> str:
    """The same rule as a jq boolean over the pod (kwok evaluates selector keys with gojq)."""
    prefixes = prefixes or image_prefixes()
    starts = " or ".join(f"startswith({json.dumps(p)})" for p in prefixes)
    label = json.dumps(SIMULATE_LABEL)
    return f'((.metadata.labels // {{}})[{label}] != "true") and ([.spec.containers[].image | {starts}] | any)'
