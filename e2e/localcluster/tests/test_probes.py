"""The pod runner's probes: a grpc probe asks the gRPC health service, as the kubelet does (the
endpoint pickers of spec.inferencePool carry one)."""

from __future__ import annotations

import socket
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from e2e.localcluster.probes import Probe

pytestmark = pytest.mark.unit


def test_a_grpc_probe_follows_the_health_service() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        probe = Probe({"grpc": {"port": port, "service": "readiness"}, "failureThreshold": 1}, "127.0.0.1", {}, {})
        probe.run()
        assert probe.ok
        servicer.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        probe.run()
        assert not probe.ok
        unknown = Probe({"grpc": {"port": port, "service": "no-such-service"}}, "127.0.0.1", {}, {})
        unknown.run()
        assert not unknown.ok and unknown.failures == 1
    finally:
        server.stop(None)
    gone = Probe({"grpc": {"port": port}, "timeoutSeconds": 1}, "127.0.0.1", {}, {})
    gone.run()
    assert not gone.ok and gone.failures == 1


def test_a_port_that_does_not_speak_http_fails_the_probe_without_raising() -> None:
    """A kubelet counts an unreadable answer as a failed probe. Here a probe error would end the
    runner thread that runs every pod's probes, so every pod would stay as last reported."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer_garbage() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(1024)
                connection.sendall(b"\x00\x01 not an HTTP status line\r\n\r\n")

        server = threading.Thread(target=answer_garbage, daemon=True)
        server.start()
        probe = Probe({"httpGet": {"path": "/ready", "port": port}, "failureThreshold": 1}, "127.0.0.1", {}, {})
        probe.run()
        server.join(5)
    assert not probe.ok and probe.failures == 1
    unnamed = Probe({"httpGet": {"path": "/", "port": "no-such-port"}, "failureThreshold": 1}, "127.0.0.1", {}, {})
    unnamed.run()
    assert not unnamed.ok and unnamed.failures == 1
