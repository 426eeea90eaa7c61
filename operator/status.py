"""`InferenceService.status`: what the operator observed, as pydantic models.

The CRD's status schema is generated from these, and `observe.py` produces them from the
Deployment and its pods. The autoscaler's averaging window lives here so that an operator
restart continues from it instead of starting blind.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from .spec import Section

ConditionType = Literal["Ready", "Progressing", "Degraded", "AdaptersReady"]


class Condition(Section):
    """One aspect of the service's state, in the standard Kubernetes condition shape."""

    type: ConditionType = Field(description="Ready, Progressing, Degraded or AdaptersReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="CamelCase cause, for machines.")
    message: str = Field("", max_length=32768, description="What happened, for humans.")
    observed_generation: int | None = Field(None, ge=0,
                                            description="metadata.generation this was computed for.")
    last_transition_time: datetime = Field(description="When status last changed.")


class AdapterStatus(Section):
    """One entry of spec.adapters, as the serving replicas hold it."""

    name: str = Field(max_length=63, description="The adapter's model id.")
    source: str = Field(max_length=512, description="Where it is loaded from.")
    loaded_replicas: int = Field(0, ge=0, description="Replicas holding it.")
    ready_replicas: int = Field(0, ge=0, description="Replicas whose engine answers (their containers "
                                                     "are ready), which should all hold it.")


class ReplicaAdapters(Section):
    """The adapters one serving engine pod reports (its /v1/models)."""

    pod: str = Field(max_length=253, description="Engine pod name.")
    adapters: list[str] = Field(default_factory=list, max_length=256,
                                description="Adapter names the engine holds.")


class MetricSample(Section):
    """One autoscaler reading: the metric summed over the Ready pods."""

    time: datetime = Field(description="When the pods were scraped.")
    value: float = Field(ge=0, description="Sum of the metric over the scraped pods.")
    pods: int = Field(ge=0, description="Pods scraped successfully.")


class AutoscalerStatus(Section):
    """The built-in autoscaler's memory, kept here so it survives operator restarts."""

    samples: list[MetricSample] = Field(default_factory=list, max_length=720,
                                        description="Readings inside the averaging window.")
    average_value: float | None = Field(None, ge=0,
                                        description="Window average of the summed metric.")
    proposed_replicas: int | None = Field(None, ge=0, description="Latest unclamped proposal.")
    below_since: datetime | None = Field(
        None, description="Since when proposals stayed below the current replicas; scale down "
                          "waits scaleDownDelaySeconds from here.")
    below_peak: int | None = Field(None, ge=0, description="Highest proposal since belowSince: "
                                                           "where a scale-down goes.")
    observed_replicas: int | None = Field(
        None, ge=0, description="spec.replicas at the last tick; a change means someone else "
                                "scaled, which restarts the scale-down clock.")
    scrape_errors: int = Field(0, ge=0, description="Failed pod scrapes in the last round.")


class ColdStart(Section):
    """Where a new engine pod's start went, from its container statuses."""

    pod: str = Field(max_length=253, description="The engine pod.")
    node: str | None = Field(None, max_length=253, description="Its node.")
    ready_time: datetime = Field(description="When it first passed its readiness probe.")
    fetch_seconds: float | None = Field(None, ge=0, description="The fetch-model init container: waiting for "
                                        "the node cache's lock and downloading (0 to 1 s when the node was warm).")
    cache_wait_seconds: float | None = Field(None, ge=0, description="Of fetchSeconds: waiting for another pod's "
                                             "download of the same weights on this node (the cache's lock).")
    download_seconds: float | None = Field(None, ge=0, description="Of fetchSeconds: this pod's own download.")
    bytes_downloaded: int | None = Field(None, ge=0, description="Bytes this pod's fetch downloaded (0: the "
                                         "node's cache had them).")
    revision: str | None = Field(None, max_length=64, description="The revision its fetch found: the commit, "
                                 "or an s3:// prefix's listing digest.")
    load_seconds: float = Field(ge=0, description="Engine start to first Ready: loading the weights, warm-up.")
    total_seconds: float = Field(ge=0, description="Pod creation to first Ready (scheduling included).")


class ModelStatus(Section):
    """The weights the engine pods serve, as resolved from spec.model.source."""

    source: str = Field(max_length=512, description="spec.model.source this was resolved from.")
    revision: str | None = Field(None, max_length=64, description="hf://: the commit every pod of the current "
                                 "pod template serves (a branch or tag resolved once; a moved head changes it "
                                 "only with the next template change). s3://: the digest of the prefix's listing "
                                 "(keys, sizes, ETags) the latest engine pod's fetch found.")
    resolved_generation: int | None = Field(None, ge=0, description="metadata.generation when it was resolved.")
    template_hash: str | None = Field(None, max_length=64, description="The pod template it was resolved for.")
    cached_nodes: list[str] | None = Field(None, max_length=1000, description="Nodes labelled as holding "
                                           "these weights in their cache (engine pods prefer them).")
    last_cold_start: ColdStart | None = Field(None, description=ColdStart.__doc__)


class InferenceServiceStatus(Section):
    """Observed state of the InferenceService."""

    observed_generation: int | None = Field(None, ge=0,
                                            description="Last metadata.generation applied.")
    conditions: list[Condition] = Field(
        default_factory=list, max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Ready, Progressing, Degraded and, when LoRA is on, AdaptersReady (False "
                    "with reason AdapterLoadFailed and the engine's error when an adapter "
                    "fails to load).")
    replicas: int = Field(0, ge=0, description="Engine pods that exist.")
    ready_replicas: int = Field(0, ge=0, description="Engine pods passing their readiness probe.")
    updated_replicas: int = Field(0, ge=0, description="Pods already running the current spec.")
    desired_replicas: int | None = Field(None, ge=0, description="Replicas asked for.")
    replica_summary: str | None = Field(None, max_length=32,
                                        description="'ready/desired', for kubectl get.")
    selector: str | None = Field(None, max_length=1024,
                                 description="Label selector of the pods (scale subresource).")
    url: str | None = Field(None, max_length=1024, description="In-cluster endpoint.")
    served_model_name: str | None = Field(
        None, max_length=1024, description="The model id clients send (`model` in requests, /v1/models); "
                                           "unset when the engine names it from the weights (pvc://).")
    adapters: list[AdapterStatus] = Field(
        default_factory=list, max_length=64,
        description="Per entry of spec.adapters: how many serving replicas hold it.")
    replica_adapters: list[ReplicaAdapters] = Field(
        default_factory=list, max_length=1000,
        description="Per serving engine pod: the adapters it holds.")
    model: ModelStatus | None = Field(None, description=ModelStatus.__doc__)
    last_scale_time: datetime | None = Field(None, description="Last autoscaler change.")
    autoscaler: AutoscalerStatus | None = Field(None, description=AutoscalerStatus.__doc__)
