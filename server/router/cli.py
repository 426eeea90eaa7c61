"""`kubeinfer route`: the cache-aware router and scale-from-zero gateway, in one of two modes.

    kubeinfer route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002   # standalone
    kubeinfer route --inferenceservice chat --namespace team-a                         # in-cluster

Standalone, it routes among engines you started yourself. In-cluster (the router Deployment the
operator renders, as `kubeinfer gateway`, the same command under its older name), it routes among
an InferenceService's Ready engine pods and holds requests while it has none and wakes one (the
operator, not the router, writes the engines' pod-deletion costs). The flags are `flags.py`'s;
the namespace comes from the downward API or the service-account mount.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
from typing import Sequence

import httpx
import uvicorn

from ..api.auth import ApiKeyCheck
from ..credentials import CredentialFiles, Credentials
from ..engine.kv_events import BlockHasher
from ..flags import LONG_CONTEXT_TOKENS, add_flags, default_max_body_bytes
from ..model.checkpoints.tokenizer_files import load_tokenizer
from ..tenancy import tenancy_enabled
from .activator import Activator, ActivatorConfig, GatewayMetrics
from .backends import Backends, KubeBackends, StaticBackends
from .engine_views import EngineViews
from .flags import BACKEND, EPP_FLAGS, PROCESS_FLAGS, ROUTING_FLAGS, TARGET_FLAGS, parse_urls
from .pickers import Picker, PrefixAwareConfig, make_picker
from .proxy import build_app
from .routing import Routing
from .tenancy import RouterTenancy
from .warmup import HotPrefixes, Warmer, WarmupConfig

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Below uvicorn's 5 s keep-alive timeout (the engines'), so the router never sends on a
# connection the engine is closing as idle.
KEEPALIVE_SECONDS = 4.0
MODE_DEFAULTS = {"standalone": {"host": "127.0.0.1", "port": 8000, "activation_timeout": 30.0},
                 "in-cluster": {"host": "0.0.0.0", "port": 8080, "activation_timeout": 120.0}}


def _namespace() -> str:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = parse_urls(os.environ[BACKEND.env]) if BACKEND.env in os.environ else None
    parser.add_argument(BACKEND.option, dest=BACKEND.dest, action="extend", type=parse_urls,
                        default=default, help=f"{BACKEND.help} [env {BACKEND.env}]")
    add_flags(parser, TARGET_FLAGS + PROCESS_FLAGS + ROUTING_FLAGS + EPP_FLAGS)


def mode_defaults(args: argparse.Namespace) -> str:
    """The mode `args` asks for; fills the flags whose default depends on it."""
    if bool(args.backend) == bool(args.inferenceservice):
        raise SystemExit("kubeinfer route: give --backend URLs (standalone; or KUBEINFER_BACKEND) or "
                         "--inferenceservice NAME (in-cluster; or KUBEINFER_INFERENCESERVICE), not both")
    mode = "standalone" if args.backend else "in-cluster"
    for dest, value in MODE_DEFAULTS[mode].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if mode == "in-cluster" and args.namespace is None:
        args.namespace = _namespace()
    return mode


def build_routing(args: argparse.Namespace, client: httpx.AsyncClient, metrics: GatewayMetrics,
                  api_keys: Sequence[str] = ()) -> tuple[Picker, Routing]:
    """(picker, routing) for `args.strategy`: the engines' views, and what the picker declares
    it needs: a tokenizer for routing keys, the warm-up of new engines (authenticated with the
    engines' first API key)."""
    views = EngineViews(client, interval=args.poll_interval, metrics_interval=4 * args.poll_interval,
                        admin_port=args.engine_admin_port, hasher=BlockHasher(args.kv_hash_key))
    config = PrefixAwareConfig(load_penalty_tokens=args.load_penalty_tokens, balance_factor=args.balance_factor,
                               balance_slack=args.balance_slack, kv_usage_limit=args.kv_usage_limit)
    picker = make_picker(args.strategy, views, config)
    tokenizer = None
    if args.tokenizer and picker.keyed:
        tokenizer = load_tokenizer(args.tokenizer)
    warmer = None
    if picker.warms and args.warmup_prefixes > 0:
        def count(outcome: str, tokens: int) -> None:
            metrics.warmups.labels(outcome).inc()
            metrics.warmup_tokens.inc(tokens)

        headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else None
        warmer = Warmer(HotPrefixes(), views, client,
                        WarmupConfig(prefixes=args.warmup_prefixes, max_tokens=args.warmup_tokens,
                                     hold_seconds=args.warmup_hold_seconds), count, headers)
    routing = Routing(views, tokenizer, args.block_size, args.prefix_key_tokens,
                      keyed=picker.keyed, warmer=warmer)
    return picker, routing


def router_tenancy(args: argparse.Namespace, files: CredentialFiles,
                   metrics: GatewayMetrics) -> RouterTenancy | None:
    """Tenants and quotas at the router (its HTTP face and its endpoint picker alike), with
    --tenants-file or --trust-tenant-header."""
    if not tenancy_enabled(args):
        return None
    return RouterTenancy(files.current.table, args.trust_tenant_header, args.quota_replicas,
                         files.current.api_keys, files, metrics.registry)


def follow_keys(files: CredentialFiles, routing: Routing, warmer_headers: dict[str, str] | None) -> None:
    """The key the router sends to the engines (their adapter lists, warm-ups) follows rotation."""
    def apply(credentials: Credentials) -> None:
        key = next(iter(credentials.api_keys), None)
        routing.views.api_key = key
        if warmer_headers is not None and key is not None:
            warmer_headers["Authorization"] = f"Bearer {key}"

    files.subscribe(apply)


def run(args: argparse.Namespace) -> int:
    mode = mode_defaults(args)
    # uvicorn configures only its own loggers: show ours (wake-ups, API trouble) at the
    # chosen level, and other libraries' (httpx logs every forwarded request) from warnings.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kubeinfer").setLevel(args.log_level.upper())
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                   keepalive_expiry=KEEPALIVE_SECONDS))
    files = CredentialFiles.from_args(args)
    metrics, api_keys = GatewayMetrics(), files.current.api_keys
    files.count_reloads(metrics.registry)
    picker, routing = build_routing(args, client, metrics, api_keys)
    backends: Backends
    if mode == "standalone":
        backends, name = StaticBackends(args.backend, client), "kubeinfer route"
    else:
        from ..kube.scale import KubeScaleApi   # the kubernetes client, in-cluster only

        scale = KubeScaleApi()
        backends = KubeBackends(scale, args.namespace, args.inferenceservice, scale.kube.api_client)
        name = args.inferenceservice
    activator = Activator(backends, ActivatorConfig(
        activation_timeout=args.activation_timeout, max_in_flight_per_replica=args.max_in_flight_per_replica,
        max_queued_requests=args.max_queued_requests), metrics, picker)
    routing.views.in_flight = activator.in_flight
    routing.views.api_key = next(iter(api_keys), None)   # to read the engines' adapters
    tracing = None
    if args.otlp_traces_endpoint:
        from .tracing import RouterTracing

        tracing = RouterTracing(args.otlp_traces_endpoint, args.otlp_traces_sampling_ratio)
    # the engines' limit (the operator passes theirs), for HTTP and ext_proc alike
    body_limit = args.max_request_body_bytes or default_max_body_bytes(LONG_CONTEXT_TOKENS)
    follow_keys(files, routing, routing.warmer.headers if routing.warmer is not None else None)
    tenancy = router_tenancy(args, files, metrics)
    app = build_app(activator, name, retry_after=args.retry_after, http=client,
                    api_keys=ApiKeyCheck.following(files), routing=routing,
                    tenancy=tenancy, tracing=tracing,
                    max_body_bytes=body_limit)
    if args.ext_proc_port is None:
        if not args.http:
            raise SystemExit("kubeinfer route: --no-http needs --ext-proc-port")
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        finally:
            if tracing is not None:
                tracing.shutdown()   # flush the last spans
        return 0
    from .ext_proc import EndpointPicker, PickerSettings, serve   # grpc: only in this mode

    endpoint_picker = EndpointPicker(activator, routing, PickerSettings(
        fallbacks=args.fallback_endpoints, shed_queue_depth=args.shed_queue_depth,
        max_body_bytes=body_limit, retry_after=args.retry_after), tenancy)
    asyncio.run(serve(endpoint_picker, args.host, args.ext_proc_port, app if args.http else None,
                      args.port, args.log_level, routing, args.metrics_port))
    return 0
