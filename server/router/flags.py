"""The router's flags and strategy names, defined once.

`kubeinfer route` parses them, the operator's CRD (`spec.routing`) takes its defaults and help
from them and the operator renders `spec.routing` back into them, so a knob cannot exist in
one place and not another. A leaf: it imports only the Flag machinery (no httpx, no torch).
Every flag is also an environment variable (`--strategy` <-> `KUBEINFER_STRATEGY`), like the
engine's.
"""

from __future__ import annotations

from ..flags import ENGINE_FLAGS, SERVER_FLAGS, Flag, _optional, parse_bool

# The pickers (`pickers.py`) implement these; `none` (CRD only) means no router unless the
# service scales from zero, whose router then balances by load.
STRATEGIES = ("prefix-aware", "least-load", "round-robin")


def parse_urls(text: str | list[str]) -> list[str]:
    """Backend URLs, separated by commas or whitespace."""
    if isinstance(text, list):
        return text
    return [item for item in text.replace(",", " ").split() if item]


ROUTING_FLAGS: tuple[Flag, ...] = (
    Flag("strategy", str, "prefix-aware",
         "prefix-aware: the replica holding the longest cached prefix of the request, minus a load "
         "penalty, within bounded loads; least-load: fewest requests in flight; round-robin.",
         STRATEGIES),
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
    return {f.dest: f for f in ROUTING_FLAGS + PROCESS_FLAGS}[dest]


# Where the requests go: a static list (standalone), or an InferenceService's Ready engine pods
# found through the Kubernetes API (in-cluster, the Deployment the operator renders).
BACKEND = Flag("backend", parse_urls, [], "Standalone mode: engine base URL (repeat, or comma-separate).")
TARGET_FLAGS: tuple[Flag, ...] = (
    Flag("inferenceservice", _optional(str), None,
         "In-cluster mode: the InferenceService whose Ready engine pods receive the requests, found "
         "through the Kubernetes API (and scaled from zero on a request)."),
    Flag("namespace", _optional(str), None,
         "Its namespace; default: POD_NAMESPACE, else the pod's own (service-account mount), else 'default'."),
    Flag("engine-admin-port", _optional(int), None,
         "The engines' --admin-port, where the router reads /kv/blocks, /tokenizer_info and the adapters "
         "(/v1/models); default: the port of each backend URL (engines without --admin-port). The "
         "operator passes it."),
)
# Defaults that depend on the mode are None here and resolved by `cli.mode_defaults`.
PROCESS_FLAGS: tuple[Flag, ...] = (
    Flag("host", _optional(str), None, "Address to bind; default: 127.0.0.1 standalone, 0.0.0.0 in-cluster."),
    Flag("port", _optional(int), None, "Port to bind; default: 8000 standalone, 8080 in-cluster."),
    Flag("activation-timeout", _optional(float), None,
         "Seconds a request waits for a Ready backend before 503 + Retry-After; default: 30 standalone, "
         "120 in-cluster (the operator passes spec.autoscaling.activationTimeoutSeconds)."),
    Flag("retry-after", int, 10, "Retry-After seconds sent with that 503."),
    Flag("max-in-flight-per-replica", int, 0,
         "Requests this router sends one engine replica at most; more wait in its queue, released by "
         "priority, then a fair share of tokens across tenants (0: no limit)."),
    Flag("max-queued-requests", int, 4096,
         "Requests the router's queue holds at most (waiting for a Ready replica or a free slot); "
         "past it, 503 with Retry-After at once."),
    Flag("log-level", str, "info", "Log level.", ("debug", "info", "warning", "error")),
    # the engine's own flags, so the operator gives both processes the same env: the API keys,
    # the body limit, the secret of the block hashes
    *(f for f in SERVER_FLAGS if f.dest in ("api_keys", "api_keys_file", "require_api_key",
                                            "key_reload_seconds", "max_request_body_bytes")),
    *(f for f in ENGINE_FLAGS if f.dest == "kv_hash_key"),
    # the engine's tenant flags (docs/tenancy.md): quotas are enforced here too, per replica
    *(f for f in SERVER_FLAGS if f.dest in ("tenants_file", "trust_tenant_header")),
    # the engine's tracing flags: the router's `route` spans join the same traces (router/tracing.py)
    *(f for f in SERVER_FLAGS if f.dest in ("otlp_traces_endpoint", "otlp_traces_sampling_ratio")),
    Flag("quota-replicas", int, 1,
         "Router replicas sharing the tenants' quotas: each enforces quota / this (server/router/tenancy.py)."),
)
# The endpoint-picker mode (`ext_proc.py`): what a Gateway API Inference Extension gateway asks.
EPP_FLAGS: tuple[Flag, ...] = (
    Flag("ext-proc-port", _optional(int), None,
         "Also serve Envoy's ext_proc on this port: the router as a Gateway API Inference Extension "
         "endpoint picker (GIE's EPP protocol and gRPC health), with the same picker as the HTTP mode."),
    Flag("http", parse_bool, True, "Serve the HTTP router on --port (--no-http: ext_proc only)."),
    Flag("metrics-port", _optional(int), None,
         "ext_proc with --no-http: serve the router's Prometheus metrics (/metrics) on this port, as GIE's "
         "EPP does on 9090; with the HTTP router they are on --port."),
    Flag("fallback-endpoints", int, 0,
         "ext_proc: endpoints listed after the picked one in x-gateway-destination-endpoint and the "
         "envoy.lb metadata, least loaded first, for gateways that retry down the list (0: the picked "
         "one only, which an ORIGINAL_DST cluster keyed on the header needs)."),
    Flag("shed-queue-depth", int, 0,
         "ext_proc: answer 429 when every candidate endpoint has this many requests waiting "
         "(vllm:num_requests_waiting); 0: never shed."),
)
