"""`kubeinfer route`: the cache-aware router in front of engines you started yourself.

    kubeinfer route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 \\
        --host 127.0.0.1 --port 8000 --strategy prefix-aware

The same routing core runs in Kubernetes as `kubeinfer gateway --strategy ...` (the operator's
router Deployment); `ROUTING_FLAGS` are shared by both. Every flag is also an environment
variable (`--strategy` <-> `KUBEINFER_STRATEGY`), like the engine's.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Sequence

from kubeinfer.server.flags import Flag, _optional, add_flags


def parse_urls(text: str | list[str]) -> list[str]:
    """Backend URLs, separated by commas or whitespace."""
    if isinstance(text, list):
        return text
    return [item for item in text.replace(",", " ").split() if item]


ROUTING_FLAGS: tuple[Flag, ...] = (
    Flag("strategy", str, "prefix-aware",
         "prefix-aware: the replica holding the longest cached prefix of the request, minus a load "
         "penalty, within bounded loads; least-load: fewest requests in flight; round-robin.",
         ("prefix-aware", "least-load", "round-robin")),
    Flag("tokenizer", _optional(str), None,
         "Model source whose tokenizer and chat template the router uses ('embedded', a Hugging Face "
         "directory or a .gguf file); default: the engines' own, from GET /tokenizer_info."),
    Flag("block-size", int, 16, "The engines' KV block size, with --tokenizer (else read from the engines)."),
    Flag("prefix-key-tokens", int, 256,
         "Requests sharing this many leading tokens go to the same replica when none has them cached."),
    Flag("load-penalty-tokens", float, 32.0, "Cached tokens one request in flight on a replica is worth."),
    Flag("balance-factor", float, 1.0,
         "A replica whose load exceeds (1 + this) x the mean load, plus --balance-slack, gets no new request."),
    Flag("balance-slack", float, 2.0, "Requests a replica may exceed the bounded load by."),
    Flag("kv-usage-limit", float, 0.95, "A replica whose KV cache is this full gets no new request."),
    Flag("poll-interval", float, 0.5, "Seconds between reads of each engine's /kv/blocks (its /metrics: 4x that)."),
    Flag("warmup-prefixes", int, 8,
         "With prefix-aware: an engine that becomes Ready (scale-up, replaced pod) gets this many of the "
         "hottest shared prefixes as prefill-only requests, in the background; 0 turns warm-up off."),
    Flag("warmup-tokens", int, 16384, "Prompt tokens one warm-up sends to an engine at most."),
    Flag("warmup-hold-seconds", float, 60.0,
         "While a prefix is being warmed on an engine, requests it would serve go to other replicas "
         "within the bounded load, until its warm-up ends or for this long at most; 0: no hold."),
)


def routing_flag(dest: str) -> Flag:
    """The router flag behind a `spec.routing` field or a `PrefixAwareConfig` default."""
    return {f.dest: f for f in ROUTING_FLAGS}[dest]


STANDALONE_FLAGS: tuple[Flag, ...] = (
    Flag("host", str, "127.0.0.1", "Address to bind."),
    Flag("port", int, 8000, "Port to bind."),
    Flag("activation-timeout", float, 30.0,
         "Seconds a request waits for a Ready backend before 503 + Retry-After."),
    Flag("log-level", str, "info", "Log level.", ("debug", "info", "warning", "error")),
)
# Below uvicorn's 5 s keep-alive timeout (the engines'), so the router never sends on a
# connection the engine is closing as idle.
KEEPALIVE_SECONDS = 4.0
BACKEND = Flag("backend", parse_urls, [], "Engine base URL (repeat, or comma-separate).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    import os

    default = parse_urls(os.environ[BACKEND.env]) if BACKEND.env in os.environ else None
    parser.add_argument(BACKEND.option, dest=BACKEND.dest, action="extend", type=parse_urls,
                        default=default, help=f"{BACKEND.help} [env {BACKEND.env}]")
    add_flags(parser, STANDALONE_FLAGS + ROUTING_FLAGS)


def build_routing(args: argparse.Namespace, client: Any, metrics: Any,
                  api_keys: Sequence[str] = ()) -> tuple[Any, Any]:
    """(picker, routing) for `args.strategy`: the engines' views, the tokenizer and, with
    prefix-aware, the warm-up of new engines (authenticated with the engines' first API key)."""
    from .engine_views import EngineViews
    from .pickers import PrefixAwareConfig, make_picker
    from .routing import Routing
    from .warmup import HotPrefixes, Warmer, WarmupConfig

    views = EngineViews(client, interval=args.poll_interval, metrics_interval=4 * args.poll_interval)
    config = PrefixAwareConfig(load_penalty_tokens=args.load_penalty_tokens, balance_factor=args.balance_factor,
                               balance_slack=args.balance_slack, kv_usage_limit=args.kv_usage_limit)
    picker = make_picker(args.strategy, views, config)
    tokenizer = None
    if args.tokenizer and args.strategy == "prefix-aware":
        from kubeinfer.server.model.tokenizer_files import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    warmer = None
    if args.strategy == "prefix-aware" and args.warmup_prefixes > 0:
        def count(outcome: str, tokens: int) -> None:
            metrics.warmups.labels(outcome).inc()
            metrics.warmup_tokens.inc(tokens)

        headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else None
        warmer = Warmer(HotPrefixes(), views, client,
                        WarmupConfig(prefixes=args.warmup_prefixes, max_tokens=args.warmup_tokens,
                                     hold_seconds=args.warmup_hold_seconds), count, headers)
    routing = Routing(views, tokenizer, args.block_size, args.prefix_key_tokens,
                      keyed=args.strategy == "prefix-aware", warmer=warmer)
    return picker, routing


def run(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from .activator import Activator, ActivatorConfig, GatewayMetrics
    from .backends import StaticBackends
    from .proxy import build_app

    if not args.backend:
        raise SystemExit("kubeinfer route: give at least one --backend URL (or KUBEINFER_BACKEND)")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kubeinfer").setLevel(args.log_level.upper())
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                   keepalive_expiry=KEEPALIVE_SECONDS))
    backends = StaticBackends(args.backend, client)
    metrics = GatewayMetrics()
    picker, routing = build_routing(args, client, metrics)
    activator = Activator(backends, ActivatorConfig(activation_timeout=args.activation_timeout), metrics, picker)
    routing.views.in_flight = activator.in_flight
    app = build_app(activator, "kubeinfer route", http=client, routing=routing)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
