"""Local service proxy: every Service port of the local cluster on its own 127.0.0.1 port.

Test and demo infrastructure, not product; it plays kube-proxy's part for this machine. A real
cluster sends ClusterIP traffic to the Service's EndpointSlices, but the API rejects loopback
addresses in EndpointSlices, and the local pods live on loopback IPs. So the proxy selects a
Service's Ready pods itself (the selector, ``targetPort`` by number or container-port name),
and forwards each TCP connection to the next one in turn. Ports are handed out from a range
and kept for the cluster's life (also across a Service's delete and re-create), so a URL the
demo printed keeps answering; the table lives in ``<state>/services.json`` and
``python -m e2e.localcluster status`` prints it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config

log = logging.getLogger("svcproxy")
RESYNC_SECONDS = 1.0


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service: what a loopback port stands for."""

    namespace: str
    name: str
    port: int
    port_name: str
    target: int | str  # targetPort: a number or a container port's name
    selector: tuple[tuple[str, str], ...]
    cluster_ip: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}:{self.port}"


def service_ports(services: list[dict[str, Any]]) -> list[ServicePort]:
    """The TCP ports of Services that select pods (not headless, not ExternalName)."""
    found = []
    for svc in services:
        spec, meta = svc.get("spec") or {}, svc["metadata"]
        if not spec.get("selector") or spec.get("clusterIP") in (None, "None") or spec.get("type") == "ExternalName":
            continue
        for port in spec.get("ports") or []:
            if port.get("protocol", "TCP") != "TCP":
                continue
            found.append(ServicePort(meta["namespace"], meta["name"], port["port"], port.get("name", ""),
                                     port.get("targetPort", port["port"]), tuple(sorted(spec["selector"].items())),
                                     spec.get("clusterIP", "")))
    return found


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _target_port(pod: dict[str, Any], target: int | str) -> int | None:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    return next((p["containerPort"] for c in pod["spec"].get("containers", []) for p in c.get("ports") or []
                 if p.get("name") == target), None)


def backends(port: ServicePort, pods: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(pod IP, port) of the Ready pods the Service selects, in a stable order."""
    found = []
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if pod["metadata"]["namespace"] != port.namespace or not _ready(pod):
            continue
        if all(labels.get(k) == v for k, v in port.selector):
            target = _target_port(pod, port.target)
            if target is not None:
                found.append((pod["status"]["podIP"], target))
    return sorted(found)


def assign(table: dict[str, int], wanted: list[str], ports: range) -> dict[str, int]:
    """Keep every existing assignment; give new keys the lowest free port. When the range is
    full, ports of Services that no longer exist are reused."""
    table = dict(table)
    for key in wanted:
        if key in table:
            continue
        free = sorted(set(ports) - set(table.values()))
        if not free:
            gone = [k for k in table if k not in wanted]
            if not gone:
                log.warning("no loopback port left for %s (range %s-%s)", key, ports.start, ports.stop - 1)
                continue
            free = [table.pop(gone[0])]
        table[key] = free[0]
    return table


@dataclass
class Proxy:
    core: client.CoreV1Api
    ports: range
    table_path: Path
    table: dict[str, int] = field(default_factory=dict)
    services: dict[str, ServicePort] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    servers: dict[str, asyncio.Server] = field(default_factory=dict)
    turns: dict[str, itertools.count] = field(default_factory=dict)

    def _list(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        services = json.loads(self.core.list_service_for_all_namespaces(_preload_content=False).data)["items"]
        pods = json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        return services, pods

    async def sync(self) -> None:
        services, self.pods = await asyncio.to_thread(self._list)
        self.services = {p.key: p for p in service_ports(services)}
        self.table = assign(self.table, list(self.services), self.ports)
        for key in set(self.servers) - set(self.services):
            self.servers.pop(key).close()
            log.info("closed %s", key)
        for key, port in self.table.items():
            if key in self.services and key not in self.servers:
                try:
                    self.servers[key] = await asyncio.start_server(
                        lambda r, w, key=key: self.forward(key, r, w), "127.0.0.1", port)
                    log.info("%s on 127.0.0.1:%d", key, port)
                except OSError as err:  # taken by something else: try again on the next sync
                    log.warning("%s: cannot listen on 127.0.0.1:%d: %s", key, port, err)
        self.write_table()

    def write_table(self) -> None:
        rows = [{"namespace": s.namespace, "name": s.name, "port": s.port, "portName": s.port_name,
                 "clusterIP": s.cluster_ip, "local": f"127.0.0.1:{self.table[key]}",
                 "serving": key in self.servers,
                 "endpoints": [f"{ip}:{port}" for ip, port in backends(s, self.pods)]}
                for key, s in sorted(self.services.items()) if key in self.table]
        tmp = self.table_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"assigned": self.table, "services": rows}, indent=1) + "\n")
        os.replace(tmp, self.table_path)

    async def forward(self, key: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pipe one client connection to the next Ready pod; one that refuses it (gone since the
        last sync, up to RESYNC_SECONDS ago) passes it to the next, as kube-proxy's userspace
        mode did; none Ready or none accepting: close it at once."""
        service = self.services.get(key)
        targets = backends(service, self.pods) if service else []
        start = next(self.turns.setdefault(key, itertools.count())) % max(len(targets), 1)
        for ip, port in targets[start:] + targets[:start]:
            try:
                up_reader, up_writer = await asyncio.open_connection(ip, port)
                break
            except OSError as err:
                log.warning("%s: %s:%d refused the connection: %s", key, ip, port, err)
        else:
            writer.close()
            return
        pipes = [asyncio.create_task(_pipe(reader, up_writer)), asyncio.create_task(_pipe(up_reader, writer))]
        done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:  # one side was reset: drop both, as a TCP proxy does
            task.cancel()
        for task in done:
            task.exception()  # retrieved: a reset is an ordinary end here
        writer.close()
        up_writer.close()

    async def run(self) -> None:
        if self.table_path.exists():
            with contextlib.suppress(ValueError, KeyError):
                self.table = json.loads(self.table_path.read_text())["assigned"]
        while True:
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - the proxy must outlive apiserver hiccups
                log.exception("sync failed")
            await asyncio.sleep(RESYNC_SECONDS)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction; pass the end of it on as a half-close."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


def read_table(path: Path) -> list[dict[str, Any]]:
    """The proxy's published rows (empty before it first synced)."""
    try:
        return json.loads(path.read_text())["services"]
    except (OSError, ValueError, KeyError):
        return []


def local_url(path: Path, namespace: str, name: str, port: int | None = None) -> str | None:
    """``http://127.0.0.1:<port>`` that serves Service ``namespace/name`` (its first port by default)."""
    rows = [r for r in read_table(path) if r["namespace"] == namespace and r["name"] == name and r["serving"]
            and (port is None or r["port"] == port)]
    return f"http://{rows[0]['local']}" if rows else None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.localcluster.svcproxy", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--ports", required=True, help="loopback port range, e.g. 61410-61499")
    parser.add_argument("--table", type=Path, required=True, help="where the port table is written")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    first, last = (int(p) for p in args.ports.split("-"))
    core = client.CoreV1Api(config.new_client_from_config(config_file=args.kubeconfig))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(Proxy(core, range(first, last + 1), args.table).run())


if __name__ == "__main__":
    main()
