"""`kubeinfer operator`: run the InferenceService controller (kopf).

Peering: every replica gets a distinct priority (random unless --priority is given), so kopf
lets exactly one act and pauses the others until it goes away.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import random

import kopf
from prometheus_client import start_http_server

from kubeinfer.server.kube.client import Kube, KubeError, load_api_client
from kubeinfer.server.kube.scale import KubeScaleApi
from . import api
from .autoscaler.handlers import register as register_autoscaler
from .autoscaler.deletion_cost import register as register_deletion_costs
from .handlers import register
from .reconcile import Reconciler
from .resource import NetworkPolicyConfig, OperatorConfig

PEERING_PATHS = {"cluster": "/apis/kopf.dev/v1/clusterkopfpeerings",
                 "namespaced": "/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings"}


def default_engine_image() -> str:
    return f"kubeinfer/kubeinfer:{importlib.metadata.version('kubeinfer')}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="Watch only this namespace (repeatable).")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="Watch the whole cluster (the default when no --namespace is given).")
    parser.add_argument("--engine-image", default=os.environ.get("KUBEINFER_ENGINE_IMAGE",
                                                                 default_engine_image()),
                        help="Image of engine pods whose spec.engine.image is unset "
                             "[env KUBEINFER_ENGINE_IMAGE].")
    parser.add_argument("--otlp-traces-endpoint", default=os.environ.get("KUBEINFER_OTLP_TRACES_ENDPOINT") or None,
                        help="OTLP/HTTP traces endpoint for engines whose spec.tracing.otlpEndpoint is "
                             "unset (the chart's tracing.otlpEndpoint) [env KUBEINFER_OTLP_TRACES_ENDPOINT].")
    parser.add_argument("--allowed-image", dest="allowed_images", action="append", default=[],
                        metavar="PATTERN",
                        help="An engine image InferenceServices may run (fnmatch pattern, e.g. "
                             "'registry.example.com/kubeinfer/*'; repeatable). Set: any other "
                             "spec.engine.image is refused (Degraded/ImageNotAllowed), nothing is created.")
    parser.add_argument("--network-policy", action="store_true",
                        help="Give each InferenceService a NetworkPolicy: only its routers, its own "
                             "engine pods (multi-node ranks), the operator and --network-policy-allow-from "
                             "reach its engine pods (all clients reach their API port when no router "
                             "fronts them); the admin port is never open to clients.")
    parser.add_argument("--network-policy-allow-from", default="[]", metavar="JSON",
                        help="NetworkPolicyPeers (a JSON list) also let in, e.g. Prometheus's namespace.")
    parser.add_argument("--cluster-domain", default="cluster.local",
                        help="DNS suffix used in status.url.")
    parser.add_argument("--model-cache-path", default="/var/lib/kubeinfer/models",
                        help="Each node's model cache for hf:// and s3:// sources (a hostPath).")
    parser.add_argument("--model-cache-claim", default=None,
                        help="Instead of the hostPath: this PersistentVolumeClaim in each InferenceService's "
                             "namespace (ReadWriteMany: fetched once per cluster).")
    parser.add_argument("--model-cache-budget", default=None,
                        help="Evict least recently used models no pod serves beyond this size (e.g. 500Gi).")
    parser.add_argument("--hf-endpoint", default=os.environ.get("HF_ENDPOINT") or None,
                        help="Hugging Face Hub mirror for hf:// sources whose spec.model.endpoint is unset "
                             "[env HF_ENDPOINT].")
    parser.add_argument("--drift-interval", type=float, default=60.0,
                        help="Seconds between full re-applies of each InferenceService.")
    parser.add_argument("--bind-address", default="0.0.0.0",
                        help="Address of the health and metrics endpoints (the chart passes the "
                             "pod IP).")
    parser.add_argument("--health-port", type=int, default=8080,
                        help="Liveness endpoint port (GET /healthz).")
    parser.add_argument("--metrics-port", type=int, default=8081,
                        help="Prometheus metrics port (0 disables).")
    parser.add_argument("--peering-name", default="kubeinfer",
                        help="kopf peering object shared by the operator's replicas.")
    parser.add_argument("--standalone", action="store_true",
                        help="No peering (a single replica; no kopf.dev CRDs needed).")
    parser.add_argument("--priority", type=int, default=None,
                        help="Peering priority (default: random, so replicas never tie).")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def ensure_peering(kube: Kube, name: str, namespaces: list[str]) -> None:
    """Create the peering object(s) kopf heartbeats into; an existing one is fine."""
    targets = [(PEERING_PATHS["namespaced"].format(ns=ns), "KopfPeering", ns) for ns in namespaces] \
        or [(PEERING_PATHS["cluster"], "ClusterKopfPeering", None)]
    for path, kind, ns in targets:
        meta = {"name": name, **({"namespace": ns} if ns else {})}
        try:
            kube.request("POST", path, {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": meta})
        except KubeError as exc:
            if exc.status == 404:
                raise SystemExit(f"kopf peering CRDs are missing ({kind}): install the chart with "
                                 "crds.install=true, or run with --standalone") from exc
            if exc.status != 409:
                raise


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kube = Kube(load_api_client())
    policy = NetworkPolicyConfig(operator_namespace=os.environ.get("POD_NAMESPACE", "kubeinfer-system"),
                                 allow_from=tuple(json.loads(args.network_policy_allow_from))) \
        if args.network_policy else None
    config = OperatorConfig(engine_image=args.engine_image, cluster_domain=args.cluster_domain,
                            otlp_traces_endpoint=args.otlp_traces_endpoint,
                            model_cache_path=args.model_cache_path, model_cache_claim=args.model_cache_claim,
                            model_cache_budget=args.model_cache_budget, hf_endpoint=args.hf_endpoint,
                            allowed_images=tuple(args.allowed_images), network_policy=policy)
    registry = kopf.get_default_registry()  # it carries kopf's default login handlers
    register(registry, Reconciler(kube, config), drift_seconds=args.drift_interval)
    scale = KubeScaleApi(kube)
    register_autoscaler(registry, scale)
    register_deletion_costs(registry, scale)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.bind_address)
    if not args.standalone:
        ensure_peering(kube, args.peering_name, args.namespace)
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    logging.getLogger(__name__).info("watching %s for %s.%s (engine image %s, priority %d)",
                                     ",".join(args.namespace) or "all namespaces", api.PLURAL,
                                     api.GROUP, args.engine_image, priority)
    # kopf makes peering mandatory whenever a peering name is passed, and then waits for the
    # peering CRD forever, even with standalone=True: name it only when peering is wanted.
    peering = {} if args.standalone else {"peering_name": args.peering_name}
    kopf.run(registry=registry, clusterwide=not args.namespace, namespaces=args.namespace,
             standalone=args.standalone, priority=priority, **peering,
             liveness_endpoint=f"http://{args.bind_address}:{args.health_port}/healthz")
    return 0
