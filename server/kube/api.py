"""The InferenceService's identity on the wire and the labels that find its engine pods.

The operator stamps these, the autoscaler and the router look them up: one home, so neither
side can rename them alone.
"""

from __future__ import annotations

from typing import Mapping

GROUP = "kubeinfer.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
INSTANCE_LABEL = "kubeinfer.io/inferenceservice"
FIELD_MANAGER = "kubeinfer-operator"   # who server-side applies (the client's `apply`)


def engine_selector_labels(name: str) -> dict[str, str]:
    """Immutable Deployment selector of an InferenceService's engines: never add labels here."""
    return {INSTANCE_LABEL: name, "app.kubernetes.io/component": "engine"}


def gateway_selector_labels(name: str) -> dict[str, str]:
    """The router pods of InferenceService `name` (never matches its engines' selector)."""
    return {INSTANCE_LABEL: name, "app.kubernetes.io/component": "gateway"}


def label_selector(labels: Mapping[str, str]) -> str:
    """`labels` as a label-selector string (`k=v,k=v`), for list calls and status.selector."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
