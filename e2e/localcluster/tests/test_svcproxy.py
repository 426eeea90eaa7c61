"""The local service proxy without a cluster: which pods a Service reaches, stable port
assignment, and real TCP forwarding on loopback that takes turns between Ready pods."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from e2e.localcluster import svcproxy

pytestmark = pytest.mark.integration


def service(name: str, selector: dict[str, str] | None, target: int | str = "http", **spec: object) -> dict:
    return {"metadata": {"namespace": "ns", "name": name},
            "spec": {"selector": selector, "clusterIP": "127.96.0.9",
                     "ports": [{"name": "http", "port": 80, "targetPort": target, "protocol": "TCP"}], **spec}}


def pod(name: str, ip: str, ready: bool = True, app: str = "a", port: int = 8000) -> dict:
    return {"metadata": {"namespace": "ns", "name": name, "labels": {"app": app}},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_only_selecting_services_get_a_port() -> None:
    ports = svcproxy.service_ports([service("a", {"app": "a"}), service("manual", None),
                                    service("headless", {"app": "a"}, clusterIP="None"),
                                    service("ext", {"app": "a"}, type="ExternalName")])
    assert [p.key for p in ports] == ["ns/a:80"]


def test_backends_are_ready_selected_pods_with_the_named_target_port() -> None:
    [port] = svcproxy.service_ports([service("a", {"app": "a"})])
    pods = [pod("p1", "127.1.1.3"), pod("p2", "127.1.1.2"), pod("notready", "127.1.1.4", ready=False),
            pod("other", "127.1.1.5", app="b")]
    assert svcproxy.backends(port, pods) == [("127.1.1.2", 8000), ("127.1.1.3", 8000)]
    [numbered] = svcproxy.service_ports([service("a", {"app": "a"}, target=9000)])
    assert svcproxy.backends(numbered, pods[:1]) == [("127.1.1.3", 9000)]


def test_assignment_is_stable_and_reuses_ports_of_deleted_services_only_when_full() -> None:
    table = svcproxy.assign({}, ["ns/a:80", "ns/b:80"], range(100, 103))
    assert table == {"ns/a:80": 100, "ns/b:80": 101}
    table = svcproxy.assign(table, ["ns/b:80", "ns/c:80"], range(100, 103))  # a deleted: keeps its port
    assert table == {"ns/a:80": 100, "ns/b:80": 101, "ns/c:80": 102}
    assert svcproxy.assign(table, ["ns/a:80", "ns/b:80", "ns/c:80"], range(100, 103)) == table  # re-created
    table = svcproxy.assign(table, ["ns/b:80", "ns/c:80", "ns/d:80"], range(100, 103))  # full: a's port goes
    assert table == {"ns/b:80": 101, "ns/c:80": 102, "ns/d:80": 100}


def serve(ip: str, name: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = name.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass
    server = http.server.ThreadingHTTPServer((ip, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class FakeCore:
    """list_* answers as the kubernetes client gives them with _preload_content=False."""

    def __init__(self, services: list[dict], pods: list[dict]) -> None:
        self.services, self.pods = services, pods

    def _items(self, items: list[dict]) -> object:
        return type("Response", (), {"data": json.dumps({"items": items}).encode()})()

    def list_service_for_all_namespaces(self, **_: object) -> object:
        return self._items(self.services)

    def list_pod_for_all_namespaces(self, **_: object) -> object:
        return self._items(self.pods)


def free_port_range(size: int) -> range:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        first = sock.getsockname()[1]
    return range(first, first + size)


async def started(core: FakeCore, table: Path) -> tuple[svcproxy.Proxy, str]:
    """A proxy synced once, and the local URL of Service ns/a."""
    proxy = svcproxy.Proxy(core, free_port_range(5), table)
    await proxy.sync()
    url = svcproxy.local_url(table, "ns", "a")
    assert url is not None
    return proxy, url


async def answers(url: str, count: int = 4) -> list[str]:
    """The bodies of `count` GETs, each on a connection of its own."""
    async with httpx.AsyncClient(trust_env=False) as http:
        return [(await http.get(url, headers={"Connection": "close"})).text for _ in range(count)]


def test_forwards_each_connection_to_the_next_ready_pod(tmp_path: Path) -> None:
    servers = [serve("127.0.0.1", "one"), serve("127.0.0.1", "two")]
    pods = [pod(f"p{i}", "127.0.0.1", port=s.server_address[1]) for i, s in enumerate(servers)]
    core = FakeCore([service("a", {"app": "a"})], pods)
    table = tmp_path / "services.json"

    async def scenario() -> list[str]:
        proxy, url = await started(core, table)
        bodies = await answers(url)
        core.pods = []  # no Ready pod: connections are closed, the port stays
        await proxy.sync()
        with pytest.raises(httpx.TransportError):
            async with httpx.AsyncClient(trust_env=False) as http:
                await http.get(url)
        assert svcproxy.read_table(table)[0]["endpoints"] == []
        for server in proxy.servers.values():
            server.close()
        return bodies

    try:
        bodies = asyncio.run(scenario())
    finally:
        for server in servers:
            server.shutdown()
    assert sorted(bodies) == ["one", "one", "two", "two"]
    assert bodies[0] != bodies[1]


def test_a_pod_gone_since_the_last_sync_passes_the_connection_to_the_next(tmp_path: Path) -> None:
    """A pod listed Ready whose process has exited (the list is up to RESYNC_SECONDS old)
    refuses; the connection goes to the next Ready pod instead of failing the client."""
    server = serve("127.0.0.1", "alive")
    with socket.socket() as sock:   # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    core = FakeCore([service("a", {"app": "a"})],
                    [pod("dead", "127.0.0.1", port=dead_port), pod("alive", "127.0.0.1", port=server.server_address[1])])
    table = tmp_path / "services.json"

    async def scenario() -> list[str]:
        proxy, url = await started(core, table)
        bodies = await answers(url)
        for listening in proxy.servers.values():
            listening.close()
        return bodies

    try:
        assert asyncio.run(scenario()) == ["alive"] * 4
    finally:
        server.shutdown()
