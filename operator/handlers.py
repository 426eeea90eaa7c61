"""kopf wiring: thin handlers that all call `Reconciler.reconcile`.

Triggers: create / update (spec) / resume of an InferenceService, a drift timer, and events of
the children it owns (a deleted or edited Deployment is re-applied at once; pod changes only
refresh status). No finalizer: owner references make Kubernetes delete the children; the
InferenceService's own DELETED event makes the reconciler forget what it kept for it.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import api
from .events import Event
from .reconcile import Reconciler

ISVC = (api.GROUP, api.VERSION, api.PLURAL)
OWNED = {"app.kubernetes.io/managed-by": api.MANAGED_BY, api.INSTANCE_LABEL: kopf.PRESENT}
ANNOTATION_PREFIX = "kopf.kubeinfer.io"


def post(body: kopf.Body | dict[str, Any], events: list[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler,
             drift_seconds: float, workers: int = 16) -> None:
    """Attach every handler to `registry` (explicit, so tests can build their own)."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Handler progress in annotations, not status: status belongs to our own schema.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
        settings.posting.level = logging.WARNING  # our own Events say what happened
        settings.execution.max_workers = workers

    @kopf.on.resume(*ISVC, id="reconcile", registry=registry)
    @kopf.on.create(*ISVC, id="reconcile", registry=registry)
    @kopf.on.update(*ISVC, id="reconcile", field="spec", registry=registry)
    def on_spec(body: kopf.Body, reason: str, **_: Any) -> None:
        post(body, reconciler.reconcile(body, trigger=str(reason)))

    @kopf.on.event(*ISVC, id="forget", registry=registry)
    def on_isvc_event(event: kopf.RawEvent, **_: Any) -> None:
        if event["type"] == "DELETED":
            meta = event["object"]["metadata"]
            reconciler.forget(meta["uid"], meta["namespace"], meta["name"])

    @kopf.timer(*ISVC, id="drift", interval=drift_seconds, initial_delay=drift_seconds,
                 registry=registry)
    def on_drift_timer(body: kopf.Body, **_: Any) -> None:
        post(body, reconciler.reconcile(body, trigger="drift"))

    def owner_changed(body: kopf.Body, apply: bool, trigger: str) -> None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["labels"][api.INSTANCE_LABEL]
        owner = reconciler.kube.get(api.KIND, namespace, name)  # None: deleted meanwhile
        if owner is not None:
            post(owner, reconciler.reconcile(owner, trigger, apply=apply))

    @kopf.on.event("apps", "v1", "deployments", id="deployment", labels=OWNED, registry=registry)
    def on_deployment_event(body: kopf.Body, **_: Any) -> None:
        owner_changed(body, apply=True, trigger="deployment")  # a no-op apply when unchanged

    @kopf.on.event("", "v1", "services", id="child", labels=OWNED, registry=registry)
    @kopf.on.event("policy", "v1", "poddisruptionbudgets", id="child", labels=OWNED,
                    registry=registry)
    def on_child_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        if event["type"] == "DELETED":
            owner_changed(body, apply=True, trigger="child-deleted")

    @kopf.on.event("", "v1", "pods", id="pod", labels=OWNED, registry=registry)
    def on_pod_event(body: kopf.Body, **_: Any) -> None:
        owner_changed(body, apply=False, trigger="pod")
