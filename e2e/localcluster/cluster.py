"""``python -m e2e.localcluster up|down|status|env``: the local Kubernetes cluster (test/demo infrastructure).

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok run as plain processes on
127.0.0.1, plus the local pod runner (e2e/localcluster/podrunner.py) and service proxy (e2e/localcluster/svcproxy.py).
``up`` reuses a healthy cluster, ``down`` stops every process by pid and deletes the state dir,
``status`` lists the processes and the Services' local URLs, ``url [ns/]name`` prints one,
``env`` prints the shell lines that put kubeinfer, helm and KUBECONFIG in place
(``eval "$(make -s env)"``).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from kubernetes import client, config as kube_config

from . import components, nodes, pki as pki_mod, processes, provisioner, svcproxy
from .binaries import binary, ensure_all
from .config import CLUSTER_ENV, ClusterConfig
from .health import http_ok, wait_until

ORDER = ["svcproxy", "podrunner", "*", "kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]


@contextlib.contextmanager
def locked(cfg: ClusterConfig) -> Iterator[None]:
    """Serialise up/down on one state dir: concurrent test sessions share a cluster safely."""
    cfg.state_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(cfg.state_dir.parent / f".{cfg.state_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def api_client(cfg: ClusterConfig) -> client.ApiClient:
    return kube_config.new_client_from_config(config_file=str(cfg.kubeconfig))


def healthy(cfg: ClusterConfig) -> bool:
    """Every process we started is alive and the apiserver reports ready."""
    if not set(ORDER) - {"*"} <= set(processes.running(cfg.state_dir)) or not cfg.kubeconfig.exists():
        return False
    pki = pki_mod.Pki(cfg.state_dir / "pki")
    return http_ok(f"{cfg.server}/readyz", pki.ca, pki.token("admin"))


def _start(cfg: ClusterConfig, name: str, argv: list[str], ready_url: str | None = None,
           env: dict[str, str] | None = None, **auth) -> None:
    pid = processes.spawn(name, argv, cfg.state_dir, env=env)
    if ready_url:
        wait_until(lambda: http_ok(ready_url, **auth), name, timeout=45, alive=lambda: processes.pid_alive(pid))


def _install_kwok_crds(ext: client.ApiextensionsV1Api) -> None:
    """kwok reads its kubelet-API targets from these CRDs (it does not install them itself)."""
    for path in sorted(components.KWOK_CRDS.glob("*.yaml")):
        ext.create_custom_resource_definition(yaml.safe_load(path.read_text()))
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in components.KWOK_CRDS.glob("*.yaml")}
    wait_until(lambda: names <= {c.metadata.name for c in ext.list_custom_resource_definition().items
                                 if any(k.type == "Established" and k.status == "True"
                                        for k in c.status.conditions or [])}, "kwok CRDs established", timeout=30)


def _start_service_proxy(cfg: ClusterConfig) -> None:
    argv = [sys.executable, "-m", "e2e.localcluster.svcproxy", "--kubeconfig", str(cfg.kubeconfig),
            "--ports", f"{cfg.service_ports.start}-{cfg.service_ports.stop - 1}",
            "--table", str(cfg.service_table)]
    processes.spawn("svcproxy", argv, cfg.state_dir, env={"PYTHONPATH": str(Path(__file__).parents[2])})


def _pod_path() -> str:
    """Pod commands like `python`/`kubeinfer` come from this interpreter's bin dir."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def _start_runner(cfg: ClusterConfig) -> None:
    path = _pod_path()
    argv = [sys.executable, "-m", "e2e.localcluster.podrunner", "--kubeconfig", str(cfg.kubeconfig),
            "--state-dir", str(cfg.state_dir / "pods"), "--pid-dir", str(cfg.state_dir / "pids"),
            "--nodes-dir", str(cfg.state_dir / "nodes"), "--volumes-dir", str(cfg.state_dir / "volumes"),
            "--node-selector", "type=kwok"]
    processes.spawn("podrunner", argv, cfg.state_dir, env={"PATH": path, "PYTHONPATH": str(Path(__file__).parents[2])})


def up(cfg: ClusterConfig) -> float:
    """Bring the cluster up (or reuse a healthy one); returns seconds spent starting it."""
    if healthy(cfg):
        return 0.0
    down(cfg)  # a half-started or stale cluster: start from scratch
    ensure_all()
    processes.check_ports_free(cfg.ports)
    start = time.monotonic()
    try:
        _start_all(cfg)
    except BaseException:
        processes.stop(cfg.state_dir, ORDER)  # nothing left running; logs stay for the error
        raise
    return time.monotonic() - start


def _start_all(cfg: ClusterConfig) -> None:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    pki = pki_mod.create(cfg.state_dir / "pki", cfg.server, cfg.service_ip)
    auth = {"ca": pki.ca, "token": pki.token("admin")}
    _start(cfg, "etcd", components.etcd(cfg), f"http://127.0.0.1:{cfg.ports['etcd']}/health")
    _start(cfg, "kube-apiserver", components.kube_apiserver(cfg, pki), f"{cfg.server}/readyz", **auth)
    _start(cfg, "kube-controller-manager", components.kube_controller_manager(cfg, pki))
    _start(cfg, "kube-scheduler", components.kube_scheduler(cfg, pki))
    with api_client(cfg) as api:
        core = client.CoreV1Api(api)
        names = nodes.create_all(core, cfg)
        _install_kwok_crds(client.ApiextensionsV1Api(api))
        client.StorageV1Api(api).create_storage_class(provisioner.storage_class())
        _start(cfg, "kwok", components.kwok(cfg, pki), f"https://127.0.0.1:{cfg.ports['kwok']}/healthz",
               env={"PATH": _pod_path()}, **auth)  # `kubectl exec` commands are looked up on kwok's PATH
        _start_runner(cfg)
        _start_service_proxy(cfg)
        wait_until(lambda: _nodes_ready(core, names), "fake GPU nodes Ready", timeout=30)
        wait_until(lambda: _has_default_sa(core), "default ServiceAccount", timeout=30)
    for name in ("kube-controller-manager", "kube-scheduler"):
        wait_until(lambda: http_ok(f"https://127.0.0.1:{cfg.ports[name]}/healthz", **auth), name, timeout=30)


def _nodes_ready(core: client.CoreV1Api, names: list[str]) -> bool:
    ready = {n.metadata.name for n in core.list_node().items
             for c in n.status.conditions or [] if c.type == "Ready" and c.status == "True"}
    return set(names) <= ready


def _has_default_sa(core: client.CoreV1Api) -> bool:
    return any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account("default").items)


def down(cfg: ClusterConfig) -> list[int]:
    """Stop every process we started (by pid) and remove all state; returns the stopped pids."""
    stopped = processes.stop(cfg.state_dir, ORDER) if (cfg.state_dir / "pids").exists() else []
    shutil.rmtree(cfg.state_dir, ignore_errors=True)
    return stopped


def status(cfg: ClusterConfig) -> str:
    alive = processes.running(cfg.state_dir) if (cfg.state_dir / "pids").exists() else {}
    names = [n for n in ORDER if n != "*"] + sorted(set(alive) - set(ORDER))
    lines = [f"{name:<24} {'pid ' + str(alive[name]) if name in alive else 'not running'}" for name in names]
    lines.append(f"state: {cfg.state_dir}  healthy: {healthy(cfg)}")
    rows = svcproxy.read_table(cfg.service_table) if "svcproxy" in alive else []
    if rows:
        lines.append("services (from this machine, through the local service proxy):")
    for row in rows:
        where = f"http://{row['local']}" if row["serving"] else f"{row['local']} (not listening)"
        lines.append(f"  {row['namespace']}/{row['name']}:{row['port']:<6} {where:<26} "
                     f"endpoints: {', '.join(row['endpoints']) or 'none Ready'}")
    return "\n".join(lines)


def env_lines(cfg: ClusterConfig) -> list[str]:
    """Shell lines for `eval`: this cluster's settings, KUBECONFIG, and kubeinfer and helm on PATH."""
    settings = [f"export {name}={shlex.quote(os.environ[name])}" for name in CLUSTER_ENV if name in os.environ]
    path = os.pathsep.join(dict.fromkeys([str(Path(sys.executable).parent), str(binary("helm").parent)]))
    lines = [*settings, f"export KUBECONFIG={shlex.quote(str(cfg.kubeconfig))}",
             f'export PATH="{path}{os.pathsep}$PATH"']
    if not shutil.which("kubectl"):
        lines.append("echo 'kubectl (1.32+) is not on PATH: install it to use the cluster' >&2")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.localcluster", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status", "env", "url"])
    parser.add_argument("service", nargs="?", help="url: [namespace/]name of a Service (namespace: default)")
    args = parser.parse_args(argv)
    cfg = ClusterConfig()
    if args.command == "up":
        try:
            with locked(cfg):
                seconds = up(cfg)
                (cfg.state_dir / "started-by-pytest").unlink(missing_ok=True)  # yours now: tests leave it up
        except (processes.PortInUse, TimeoutError, RuntimeError) as err:
            print(f"error: {err}\nlogs: {cfg.state_dir / 'logs'}", file=sys.stderr)
            return 1
        print("reused the running cluster" if seconds == 0 else f"cluster up in {seconds:.1f} s")
        print(f"export KUBECONFIG={cfg.kubeconfig}")
    elif args.command == "env":
        print("\n".join(env_lines(cfg)))
    elif args.command == "url":
        namespace, _, name = (args.service or "").rpartition("/")
        url = svcproxy.local_url(cfg.service_table, namespace or "default", name) if name else None
        if url is None:
            print(f"error: no Service {args.service!r} served by the local service proxy (see `make cluster-status`)",
                  file=sys.stderr)
            return 1
        print(url)
    elif args.command == "down":
        with locked(cfg):
            print(f"stopped pids: {down(cfg)}")
    else:
        print(status(cfg))
    return 0
