"""`kubeinfer gateway`: the per-InferenceService router and scale-from-zero gateway process.

Runs in the gateway Deployment the operator creates for `spec.routing` (or at
`autoscaling.minReplicas` 0); its Service is the InferenceService's URL. The routing flags
are `kubeinfer route`'s. Options default from the environment so the pod spec
stays short (the namespace comes from the downward API or the service-account mount).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from kubeinfer.server.flags import SERVER_FLAGS, add_flags
from .route_cli import KEEPALIVE_SECONDS, ROUTING_FLAGS

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _namespace() -> str:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--inferenceservice", default=env("KUBEINFER_INFERENCESERVICE"),
                        required=not env("KUBEINFER_INFERENCESERVICE"),
                        help="InferenceService whose engine pods receive the requests "
                             "[env KUBEINFER_INFERENCESERVICE].")
    parser.add_argument("--namespace", default=_namespace(),
                        help="Its namespace [env POD_NAMESPACE, else the pod's own].")
    parser.add_argument("--host", default=env("KUBEINFER_HOST", "0.0.0.0"),
                        help="Address to bind [env KUBEINFER_HOST].")
    parser.add_argument("--port", type=int, default=8080, help="Port to bind.")
    parser.add_argument("--activation-timeout", type=float,
                        default=float(env("KUBEINFER_ACTIVATION_TIMEOUT", "120")),
                        help="Seconds a request is held waiting for a Ready pod before 503 "
                             "[env KUBEINFER_ACTIVATION_TIMEOUT].")
    parser.add_argument("--retry-after", type=int, default=10,
                        help="Retry-After seconds sent with that 503.")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    # the engine's own key flags, so the operator gives both processes the same env
    add_flags(parser, tuple(f for f in SERVER_FLAGS
                            if f.dest in ("api_keys", "api_keys_file", "require_api_key")))
    add_flags(parser, ROUTING_FLAGS)


def run(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from kubeinfer.server.api.auth import api_keys_from_args
    from ..autoscaler.kube import KubeScaleApi
    from .activator import Activator, ActivatorConfig, GatewayMetrics
    from .backends import KubeBackends
    from .deletion_cost import DeletionCosts
    from .proxy import build_app
    from .route_cli import build_routing

    # uvicorn configures only its own loggers: show ours (wake-ups, API trouble) at the
    # chosen level, and other libraries' (httpx logs every forwarded request) from warnings.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kubeinfer").setLevel(args.log_level.upper())
    scale = KubeScaleApi()
    backends = KubeBackends(scale, args.namespace, args.inferenceservice, scale.kube.api_client)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                   keepalive_expiry=KEEPALIVE_SECONDS))
    metrics, api_keys = GatewayMetrics(), api_keys_from_args(args)
    picker, routing = build_routing(args, client, metrics, api_keys)
    activator = Activator(backends, ActivatorConfig(activation_timeout=args.activation_timeout), metrics, picker)
    routing.views.in_flight = activator.in_flight
    routing.views.api_key = next(iter(api_keys), None)   # to read the engines' adapters
    costs = DeletionCosts(backends.pods, routing.views.cache_values, backends.patch_pod)
    routing.background.append(costs.run)
    app = build_app(activator, args.inferenceservice, retry_after=args.retry_after, http=client,
                    api_keys=api_keys, routing=routing)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
