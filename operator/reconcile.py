"""One idempotent reconcile: apply the desired children, observe them, write status.

Every kopf handler (create, update, resume, the drift timer, child events) ends up here, so
there is one code path to test. Calls for the same InferenceService are serialized; calls for
different ones run in parallel in kopf's thread pool.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any, Mapping

from pydantic import ValidationError

from kubeinfer.server.kube.api import gateway_selector_labels
from kubeinfer.server.kube.client import Kube, KubeError

from . import api, hash_key
from .adapter_sync import AdapterSync
from .adapters import AdapterReport, action_events, gate_conditions
from .children import desired_children, stale_children
from .inference_pool import POOL_CRD
from .cold_start import describe, observe_metrics
from .model_cache import evicted_labels, warm_job, warm_job_name, warm_nodes, warm_selector, warmed_nodes
from .model_pin import ResolveError, Resolver, hub_resolver, model_status, pin, template_hash
from .model_source import cache_key
from .events import Event, transition_events
from .metrics import RECONCILE_SECONDS, RECONCILES
from .build import GPU_PRODUCT_LABEL, GPU_RESOURCE, device
from .observe import Observed, lws_as_workload, observe, pod_problems
from .resource import InferenceService, OperatorConfig, label_selector
from .router_build import needs_gateway
from .status import Condition, InferenceServiceStatus


log = logging.getLogger(__name__)
CRD_CHECK_SECONDS = 60.0


def workload_kind(isvc: InferenceService) -> str:
    return api.LWS_KIND if isvc.spec.multi_pod else "Deployment"


def pod_templates(workload: dict[str, Any]) -> dict[str, Any]:
    """What a change of rolls out: a Deployment's pod template, an LWS's leader and worker templates."""
    spec = workload["spec"]
    return spec["template"] if workload["kind"] == "Deployment" else spec["leaderWorkerTemplate"]


def spec_error(error: ValidationError) -> str:
    """A schema-valid but model-invalid spec, phrased with the API's camelCase paths."""
    return "; ".join(f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                     for e in error.errors())


def previous_status(body: Mapping[str, Any]) -> InferenceServiceStatus:
    """The status as last written; an unreadable one restarts empty rather than wedging us."""
    try:
        return InferenceServiceStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return InferenceServiceStatus()


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig, adapters: AdapterSync | None = None,
                 resolve: Resolver = hub_resolver) -> None:
        self.kube, self.config, self.resolve = kube, config, resolve
        self.adapters = adapters or AdapterSync()
        self._locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        # The status we last wrote, by uid: a queued call's body predates the call before it,
        # and transition times and Events must build on what was really written last.
        self._written: dict[str, InferenceServiceStatus] = {}
        # The engine Deployment's pod template as last applied, by uid: a change is a rollout.
        self._templates: dict[str, dict[str, Any] | None] = {}
        # CRD name -> (when it was last looked up, whether it exists; None: cannot tell)
        self._crds: dict[str, tuple[float, bool | None]] = {}

    def forget(self, uid: str, namespace: str, name: str) -> None:
        """Drop what is kept per InferenceService once it is deleted (else one entry per deleted
        object would stay for the operator's lifetime); a lock in use stays with its holder."""
        self._written.pop(uid, None)
        self._templates.pop(uid, None)
        self.adapters.forget(uid)
        lock = self._locks.get((namespace, name))
        if lock is not None and not lock.locked():
            self._locks.pop((namespace, name), None)

    def reconcile(self, body: Mapping[str, Any], trigger: str, apply: bool = True) -> list[Event]:
        """Bring one InferenceService's children and status in line; returns Events to post."""
        meta = body["metadata"]
        started = time.monotonic()
        with self._locks[(meta["namespace"], meta["name"])]:
            try:
                events = self._reconcile(body, apply)
            except Exception:
                RECONCILES.labels(trigger, "error").inc()
                raise
            finally:
                RECONCILE_SECONDS.observe(time.monotonic() - started)
        RECONCILES.labels(trigger, "ok").inc()
        return events

    def _reconcile(self, body: Mapping[str, Any], apply: bool) -> list[Event]:
        previous = self._written.get(body["metadata"]["uid"]) or previous_status(body)
        applied, error = previous.observed_generation, None
        try:
            isvc = InferenceService.from_body(body)
        except ValidationError as exc:  # the CRD schema let it by, the models did not
            return self._write_invalid(body, previous, spec_error(exc))
        image = isvc.spec.engine.image or self.config.engine_image
        if not self.config.image_allowed(image):   # nothing is created or changed for it
            return self._write_invalid(body, previous, f"spec.engine.image {image} matches none of the images "
                                       f"this cluster's admin allows ({', '.join(self.config.allowed_images)})",
                                       reason="ImageNotAllowed")
        rolling_out = False
        lws_installed = self._crd_installed(api.LWS_CRD, lookup=isvc.spec.multi_pod)
        pool_installed = self._crd_installed(POOL_CRD, lookup=isvc.spec.inference_pool.enabled)
        pinned = pin(isvc, self.config, template_hash(isvc, self.config), previous.model,
                     lambda: self._model_token(isvc), self.resolve)
        if pinned.model is not None and pinned.model.revision:
            isvc = dataclasses.replace(isvc, resolved_revision=pinned.model.revision)
        if apply and pinned.error is None:  # unresolved: the Deployment keeps the template it has
            try:
                rolling_out = self._apply_children(isvc, lws_installed, pool_installed)
                applied = isvc.generation
            except KubeError as exc:
                error = f"applying children failed: {exc.message}"
        pods = self.kube.list("Pod", isvc.namespace, isvc.selector)
        worker_pods = self.kube.list("Pod", isvc.namespace, label_selector(isvc.worker_labels)) \
            if isvc.spec.multi_pod else []
        gateway_pods = self.kube.list("Pod", isvc.namespace,
                                      label_selector(gateway_selector_labels(isvc.name))) \
            if needs_gateway(isvc) else []
        adapters = self._sync_adapters(isvc, pods) if isvc.spec.lora_enabled else None
        gpu_products, gpus = self._gpu_nodes(isvc, pods)
        lws_missing = isvc.spec.multi_pod and lws_installed is False
        seen = Observed(deployment=None if lws_missing else self._workload(isvc),
                        pods=pods, applied_generation=applied, error=error,
                        gpu_products=gpu_products, gpus_allocatable=gpus, gateway_pods=gateway_pods,
                        keda_installed=self._keda_installed(isvc), adapters=adapters,
                        worker_pods=worker_pods, lws_missing=lws_missing,
                        pool_crd_missing=isvc.spec.inference_pool.enabled and pool_installed is False,
                        model_error=(pinned.error.reason, str(pinned.error)) if pinned.error else None)
        status = observe(isvc, seen, self.config, previous, datetime.now(timezone.utc))
        model, starts = model_status(isvc, pinned.model or previous.model, previous.model, pods)
        if model is not None and pinned.error is None and apply:
            model = model.model_copy(update={"cached_nodes": self._warm(isvc, pods)})
        status = status.model_copy(update={"model": model})
        self._write(isvc.uid, isvc.namespace, isvc.name, status)
        events = action_events(adapters) + transition_events(previous.conditions, status.conditions)
        for start in starts:
            observe_metrics(isvc.namespace, isvc.name, start)
            events.append(Event("Normal", "ColdStart", describe(start)))
        self._unlabel_evicted(evicted_labels(starts, pods))
        if pinned.model is not None and pinned.model.revision and previous.model is not None \
                and pinned.model.revision != previous.model.revision:
            events.append(Event("Normal", "ModelResolved", f"{isvc.spec.model.source} resolved to commit "
                                f"{pinned.model.revision} for the new pod template"))
        if rolling_out and not any(e.reason == "RollingOut" for e in events):
            # A rollout can finish before it is observed (simulated pods, a fast start), and one
            # begun while another was in flight keeps Progressing True: announce it either way.
            events.append(Event("Normal", "RollingOut", f"generation {isvc.generation} changed the "
                                f"engine's pod template; the {workload_kind(isvc)} rolls it out"))
        log.info("%s/%s generation %d applied %s: %s; events %s", isvc.namespace, isvc.name,
                 isvc.generation, applied, ", ".join(f"{c.type}={c.status}/{c.reason}" for c in status.conditions),
                 [e.reason for e in events] or "none")
        return events

    def _apply_children(self, isvc: InferenceService, lws_installed: bool | None,
                        pool_installed: bool | None = None) -> bool:
        """Apply every child, delete stale ones; True when the engines' workload already existed
        and this apply changed its pod template(s), i.e. a rollout began."""
        kind = workload_kind(isvc)
        if isvc.uid in self._templates:
            before = self._templates[isvc.uid]
        else:   # first reconcile since the operator started: what is live is the baseline
            live = None if isvc.spec.multi_pod and lws_installed is False else \
                self.kube.get(kind, isvc.namespace, isvc.name)
            before = pod_templates(live) if live else None
        rolling_out = False
        self.kube.create(hash_key.new_secret(isvc))   # before the pods that read it
        for child in desired_children(isvc, self.config, lws_installed is not False, pool_installed is not False):
            result = self.kube.apply(child)
            if child["kind"] == kind and child["metadata"]["name"] == isvc.name and result:
                after = pod_templates(result)
                rolling_out = before is not None and after != before
                self._templates[isvc.uid] = after
        for stale_kind, name in stale_children(isvc, lws_installed is True):
            self.kube.delete(stale_kind, isvc.namespace, name)
        return rolling_out

    def _workload(self, isvc: InferenceService) -> dict[str, Any] | None:
        """The engines' Deployment, or their LeaderWorkerSet seen as one (groups as replicas)."""
        if not isvc.spec.multi_pod:
            return self.kube.get("Deployment", isvc.namespace, isvc.name)
        lws = self.kube.get(api.LWS_KIND, isvc.namespace, isvc.name)
        return lws_as_workload(lws) if lws else None

    def _crd_installed(self, crd: str, lookup: bool) -> bool | None:
        """Whether a CRD (LeaderWorkerSet's, GIE's InferencePool) exists (None: cannot tell), looked
        up for the services that need it only and at most once a minute: installing it later needs no
        operator restart. Other services get what is known (a stale child is deleted where one may exist)."""
        checked, known = self._crds.get(crd, (-CRD_CHECK_SECONDS, None))
        now = time.monotonic()
        if not lookup or now - checked < CRD_CHECK_SECONDS:
            return known
        try:
            known = self.kube.get("CustomResourceDefinition", "", crd) is not None
        except KubeError:   # e.g. RBAC: apply anyway, the error then says what is wrong
            known = None
        self._crds[crd] = (now, known)
        return known

    def _sync_adapters(self, isvc: InferenceService, pods: list[dict[str, Any]]) -> AdapterReport:
        """Load and unload adapters in the Ready engines, through their admin port."""
        report = self.adapters.sync(isvc, pods)
        for pod, condition in gate_conditions(pods, report).items():
            try:
                self.kube.patch_pod_condition(isvc.namespace, pod, condition)
            except KubeError as exc:  # the pod stays out of service; the next reconcile retries
                log.warning("opening the adapters gate of pod %s/%s failed: %s", isvc.namespace, pod, exc)
        return report

    def _warm(self, isvc: InferenceService, pods: list[dict[str, Any]]) -> list[str] | None:
        """Label the nodes that now hold the weights, keep spec.model.cache.nodes warm-ahead Jobs
        (and only those); the nodes holding them, or None when nodes cannot be read."""
        try:
            nodes = self.kube.list("Node", "", "")
            jobs = self.kube.list("Job", isvc.namespace, warm_selector(isvc))
            key, wanted = cache_key(isvc), warm_nodes(isvc, nodes) if isvc.spec.model.cache.nodes else []
            holding = {n["metadata"]["name"] for n in nodes if key in (n["metadata"].get("labels") or {})}
            for node in sorted(warmed_nodes(isvc, jobs, pods) - holding):
                self.kube.label("Node", "", node, {key: "true"})
                holding.add(node)
            names = {warm_job_name(isvc, node) for node in wanted}
            for node in wanted:
                self.kube.apply(warm_job(isvc, self.config, node))
            for job in jobs:
                if job["metadata"]["name"] not in names:
                    self.kube.delete_with_dependents("Job", isvc.namespace, job["metadata"]["name"])
        except KubeError as exc:  # e.g. RBAC without nodes/patch: pods still fetch, just not ahead
            log.warning("model cache of %s/%s: %s", isvc.namespace, isvc.name, exc.message)
            return None
        return sorted(holding)

    def _unlabel_evicted(self, labels: dict[str, list[str]]) -> None:
        """Nodes no longer hold what their caches evicted: drop those models' labels."""
        for node, keys in labels.items():
            try:
                self.kube.label("Node", "", node, dict.fromkeys(keys))
            except KubeError as exc:  # e.g. RBAC without nodes/patch: the preference costs a download
                log.warning("unlabelling models evicted from node %s: %s", node, exc.message)

    def _model_token(self, isvc: InferenceService) -> str | None:
        """The hf token the revision is resolved with (model.tokenSecretRef), if any."""
        ref = isvc.spec.model.token_secret_ref
        if ref is None:
            return None
        try:
            secret = self.kube.get("Secret", isvc.namespace, ref.name) or {}
        except KubeError as exc:
            raise ResolveError("ModelAccessDenied", f"cannot read Secret {ref.name} (model.tokenSecretRef) to "
                               f"resolve the revision of {isvc.spec.model.source}: {exc.message}; pin the "
                               "source to a commit (@<sha>) or install the chart with "
                               "operator.readApiKeySecrets=true") from None
        encoded = (secret.get("data") or {}).get(ref.key)
        return base64.b64decode(encoded).decode().strip() if encoded else None

    def _gpu_nodes(self, isvc: InferenceService, pods: list[dict[str, Any]]) -> tuple[list[str] | None, int | None]:
        """Node GPU products and the GPUs all nodes advertise, read only when a service asks for
        GPUs and its pods cannot be scheduled."""
        if not (isvc.spec.resources.gpu_product or device(isvc) == "cuda") or not any(
                reason == "Unschedulable" for reason, _ in pod_problems(pods)):
            return None, None
        try:
            nodes = self.kube.list("Node", "", "")
        except KubeError:  # e.g. no RBAC for nodes: the scheduler's message still explains
            return None, None
        products = [n["metadata"]["labels"][GPU_PRODUCT_LABEL] for n in nodes
                    if GPU_PRODUCT_LABEL in (n["metadata"].get("labels") or {})]
        gpus = 0
        for node in nodes:
            try:
                gpus += int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0))
            except ValueError:  # not a plain count: GPUs of some kind are there
                gpus += 1
        return products, gpus

    def _keda_installed(self, isvc: InferenceService) -> bool | None:
        """Whether KEDA's ScaledObject CRD exists, asked only of services whose autoscaler is KEDA."""
        if isvc.autoscaler_class != "keda":
            return None
        try:
            return self.kube.get("CustomResourceDefinition", "", api.KEDA_CRD) is not None
        except KubeError:  # e.g. RBAC: say nothing rather than something wrong
            return None

    def _write_invalid(self, body: Mapping[str, Any], previous: InferenceServiceStatus,
                       message: str, reason: str = "InvalidSpec") -> list[Event]:
        meta, now = body["metadata"], datetime.now(timezone.utc)
        degraded = Condition(type="Degraded", status="True", reason=reason, message=message,
                             observed_generation=meta.get("generation"), last_transition_time=now)
        others = [c for c in previous.conditions if c.type != "Degraded"]
        status = previous.model_copy(update={"conditions": [*others, degraded]})
        self._write(meta["uid"], meta["namespace"], meta["name"], status)
        return transition_events(previous.conditions, status.conditions)

    def _write(self, uid: str, namespace: str, name: str, status: InferenceServiceStatus) -> None:
        """Only the fields this reconciler owns; the autoscaler's stay as they are."""
        body = status.model_dump(by_alias=True, mode="json", exclude_none=True,
                                 exclude={"autoscaler", "last_scale_time"})
        try:
            self.kube.patch_status(namespace, name, body)
        except KubeError as exc:
            if exc.status == 404:  # deleted meanwhile; its children go with it
                self._written.pop(uid, None)
                return
            raise
        self._written[uid] = status
