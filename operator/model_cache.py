"""Which nodes hold an InferenceService's weights, and warming more of them ahead of scale-up.

The cache itself is each node's directory, filled by whichever pod (or Job) fetches first under
the cache's lock (model_source.fetch_container). This module keeps the scheduler informed: a
node whose cache holds the pinned weights gets the label `models.kubeinfer.io/<digest>` once a
warm-ahead Job on it succeeded or an engine pod of the current template became Ready there;
engine pods prefer such nodes (build.cache_affinity). With `spec.model.cache.nodes: N` the
operator runs the same fetch as a Job on N eligible nodes (those already labelled first), so
the autoscaler's next replica, or a scale-from-zero, starts on a warm node. When a fetch
evicted models to fit its budget it names them (its termination message), and their labels go
from its node once its pod is reported (`evicted_labels`); a service whose pods still run there
labels the node again.
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import api
from .build import GPU_PRODUCT_LABEL
from .cold_start import fetch_report
from .model_source import CACHE_VOLUME, cache_key, fetch_container, model_mounts, pinned_source, source_label
from .status import ColdStart
from .resource import InferenceService, OperatorConfig, label_selector

HOSTNAME_LABEL = "kubernetes.io/hostname"
WARM_ROLE = "model-cache"
JOB_BACKOFF_LIMIT = 3


def warm_selector(isvc: InferenceService) -> str:
    return label_selector({api.INSTANCE_LABEL: isvc.name, "app.kubernetes.io/component": WARM_ROLE})


def warm_job_name(isvc: InferenceService, node: str) -> str:
    """<service>-warm-<digest of node and weights>: a new pin gets new Jobs; at most 63 characters."""
    digest = hashlib.sha256(f"{node}\0{pinned_source(isvc)}".encode()).hexdigest()[:10]
    return f"{isvc.name[:46]}-warm-{digest}"


def eligible(isvc: InferenceService, node: dict[str, Any]) -> bool:
    """A node engine pods could land on: their nodeSelector (and GPU product) match, schedulable."""
    labels = node["metadata"].get("labels") or {}
    wanted = dict(isvc.spec.node_selector)
    if isvc.spec.resources.gpu_product:
        wanted[GPU_PRODUCT_LABEL] = isvc.spec.resources.gpu_product
    return all(labels.get(k) == v for k, v in wanted.items()) and not (node.get("spec") or {}).get("unschedulable")


def warm_nodes(isvc: InferenceService, nodes: list[dict[str, Any]]) -> list[str]:
    """The N nodes to keep warm: those already holding the weights first, then by name."""
    key = cache_key(isvc)
    candidates = sorted((n for n in nodes if eligible(isvc, n)),
                        key=lambda n: (key not in (n["metadata"].get("labels") or {}), n["metadata"]["name"]))
    return [n["metadata"]["name"] for n in candidates[:isvc.spec.model.cache.nodes]]


def warm_job(isvc: InferenceService, config: OperatorConfig, node: str) -> dict[str, Any]:
    """The fetch-model container as a Job on `node`, writing into that node's cache."""
    image = isvc.spec.engine.image or config.engine_image
    cache = next(v for v in model_mounts(isvc, image, config).volumes if v["name"] == CACHE_VOLUME)
    pod_spec = {"restartPolicy": "Never", "nodeSelector": {HOSTNAME_LABEL: node},
                "tolerations": list(isvc.spec.tolerations), "automountServiceAccountToken": False,
                "enableServiceLinks": False, "containers": [fetch_container(isvc, image, config)],
                "volumes": [cache, {"name": "tmp", "emptyDir": {}}]}
    if isvc.spec.priority_class_name:
        pod_spec["priorityClassName"] = isvc.spec.priority_class_name
    labels = {api.INSTANCE_LABEL: isvc.name, "app.kubernetes.io/component": WARM_ROLE}
    meta = isvc.metadata(warm_job_name(isvc, node))
    meta["labels"] = {**meta["labels"], **labels}
    meta["annotations"] = {api.MODEL_CACHE_KEY_ANNOTATION: cache_key(isvc), api.MODEL_CACHE_NODE_ANNOTATION: node}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": JOB_BACKOFF_LIMIT,
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}


def warmed_nodes(isvc: InferenceService, jobs: list[dict[str, Any]], pods: list[dict[str, Any]]) -> set[str]:
    """Nodes that now hold the pinned weights: a warm Job for them succeeded there, or an engine
    pod whose fetch was of these weights is Ready there."""
    key, source = cache_key(isvc), pinned_source(isvc)
    found = {(j["metadata"].get("annotations") or {}).get(api.MODEL_CACHE_NODE_ANNOTATION) for j in jobs
             if (j["metadata"].get("annotations") or {}).get(api.MODEL_CACHE_KEY_ANNOTATION) == key
             and ((j.get("status") or {}).get("succeeded") or 0) > 0}
    for pod in pods:
        fetch = next((c for c in (pod.get("spec") or {}).get("initContainers") or []
                      if c["name"] == api.FETCH_CONTAINER), None)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or [])
        if fetch is not None and source in fetch.get("args", []) and ready:
            found.add(pod["spec"].get("nodeName"))
    return {n for n in found if n}


def evicted_labels(starts: list[ColdStart], pods: list[dict[str, Any]]) -> dict[str, list[str]]:
    """node -> the model labels to remove there: the sources each newly reported pod's fetch
    evicted from that node's cache."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    found: dict[str, list[str]] = {}
    for start in starts:
        pod = by_name.get(start.pod)
        if pod is None or not start.node:
            continue
        for source in fetch_report(pod).evicted:
            found.setdefault(start.node, []).append(source_label(source))
    return found
