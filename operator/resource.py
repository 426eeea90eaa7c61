"""The InferenceService as the builders see it: identity plus a validated spec."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubeinfer.server.kube.api import engine_selector_labels, label_selector
from . import api
from .spec import InferenceServiceSpec


@dataclass(frozen=True)
class NetworkPolicyConfig:
    """Who may reach engine pods besides their own router: the operator's pods (its namespace
    and pod labels), and `allow_from`, NetworkPolicy peers the chart adds (e.g. Prometheus)."""

    operator_namespace: str
    operator_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/component", "operator"),
                                                    ("app.kubernetes.io/name", "kubeinfer"))
    allow_from: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class OperatorConfig:
    """Operator-wide settings the builders need (from `kubeinfer operator` flags)."""

    engine_image: str = "kubeinfer/kubeinfer:latest"
    cluster_domain: str = "cluster.local"
    otlp_traces_endpoint: str | None = None  # engines' traces where spec.tracing.otlpEndpoint is unset
    model_cache_path: str = "/var/lib/kubeinfer/models"  # each node's cache (a hostPath)
    model_cache_claim: str | None = None  # instead: this claim (ReadWriteMany: once per cluster)
    model_cache_budget: str | None = None  # evict least recently used models beyond this size
    hf_endpoint: str | None = None  # the Hub mirror for hf:// sources that name no endpoint
    # fnmatch patterns an engine image must match (the chart's allowedImages); empty: any image
    allowed_images: tuple[str, ...] = ()
    # a NetworkPolicy per InferenceService (the chart's networkPolicy), else None
    network_policy: NetworkPolicyConfig | None = None

    def image_allowed(self, image: str) -> bool:
        return not self.allowed_images or any(fnmatch.fnmatchcase(image, p) for p in self.allowed_images)


@dataclass(frozen=True)
class InferenceService:
    name: str
    namespace: str
    uid: str
    generation: int
    spec: InferenceServiceSpec = field(default_factory=InferenceServiceSpec)
    autoscaler_class: str | None = None  # the kubeinfer.io/autoscaler-class annotation
    resolved_revision: str | None = None  # an hf:// revision's commit for this generation (model_pin.py)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> InferenceService:
        """Parse a watched object; raises pydantic.ValidationError on a spec the schema let by."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"],
                   generation=int(meta.get("generation", 1)),
                   spec=InferenceServiceSpec.model_validate(body.get("spec") or {}),
                   autoscaler_class=(meta.get("annotations") or {}).get(api.AUTOSCALER_CLASS_ANNOTATION))

    @property
    def selector_labels(self) -> dict[str, str]:
        return engine_selector_labels(self.name)

    @property
    def selector(self) -> str:
        return label_selector(self.selector_labels)

    @property
    def labels(self) -> dict[str, str]:
        return {**self.selector_labels, "app.kubernetes.io/name": "kubeinfer",
                "app.kubernetes.io/instance": self.name, "app.kubernetes.io/part-of": "kubeinfer",
                "app.kubernetes.io/managed-by": api.MANAGED_BY}

    @property
    def worker_labels(self) -> dict[str, str]:
        """A multi-pod group's worker pods: the engine labels but for the component, so only
        leaders are found by the engine selector (Service, router, autoscaler, status.selector)."""
        return {**self.labels, "app.kubernetes.io/component": api.WORKER_COMPONENT}

    def url(self, config: OperatorConfig) -> str:
        return f"http://{self.name}.{self.namespace}.svc.{config.cluster_domain}"

    def metadata(self, name: str | None = None) -> dict[str, Any]:
        """Child metadata: our labels and a controller owner reference for garbage collection."""
        return {"name": name or self.name, "namespace": self.namespace, "labels": self.labels,
                "ownerReferences": [{"apiVersion": api.API_VERSION, "kind": api.KIND,
                                     "name": self.name, "uid": self.uid, "controller": True,
                                     "blockOwnerDeletion": True}]}
