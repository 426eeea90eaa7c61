"""Liveness/readiness/startup probes against a local process, the way the kubelet runs them.

httpGet, tcpSocket and grpc (the gRPC health protocol, e.g. an endpoint picker's) go to the pod IP
(loopback here); exec runs the command locally with the container's environment. Thresholds and periods follow the pod spec, with Kubernetes' defaults.
"""
from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Probe:
    spec: dict
    host: str
    env: dict[str, str]
    ports: dict[str, int]  # named container ports, for `port: http`
    ok: bool = False  # readiness/startup start failing, liveness starts passing
    successes: int = 0
    failures: int = 0
    last_run: float = field(default=float("-inf"))

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    def _port(self, port: int | str) -> int:
        return self.ports[port] if isinstance(port, str) and not port.isdigit() else int(port)

    def _check(self) -> bool:
        timeout = float(self.spec.get("timeoutSeconds", 1))
        if "httpGet" in self.spec:
            get = self.spec["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            url = f"{scheme}://{get.get('host') or self.host}:{self._port(get['port'])}{get.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            except (OSError, urllib.error.HTTPError):
                return False
        if "tcpSocket" in self.spec:
            try:
                socket.create_connection((self.host, self._port(self.spec["tcpSocket"]["port"])), timeout).close()
                return True
            except OSError:
                return False
        if "grpc" in self.spec:
            return self._grpc_serving(self.spec["grpc"], timeout)
        if "exec" in self.spec:
            try:
                return subprocess.run(self.spec["exec"]["command"], env=self.env, timeout=timeout,
                                      capture_output=True).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False
        raise ValueError(f"unsupported probe {sorted(self.spec)}")

    def _grpc_serving(self, spec: dict, timeout: float) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"{self.host}:{int(spec['port'])}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec.get("service", "")), timeout=timeout)
            except grpc.RpcError:
                return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def due(self, started_at: float, now: float) -> bool:
        return now - started_at >= self.spec.get("initialDelaySeconds", 0) and now - self.last_run >= self.period

    def run(self, now: float | None = None) -> None:
        """One probe; like the kubelet's, any error on the way (a server that is not HTTP on the
        port, a bad status line, a named port the container lacks) is a failed probe, not the
        runner's error."""
        self.last_run = time.monotonic() if now is None else now
        try:
            passed = self._check()
        except Exception:  # noqa: BLE001 - an answer we cannot read is a failure
            passed = False
        if passed:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1
        if self.successes >= self.spec.get("successThreshold", 1):
            self.ok = True
        elif self.failures >= self.spec.get("failureThreshold", 3):
            self.ok = False
