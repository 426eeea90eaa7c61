"""A runner pod: its directory (service-account token, CA, kubeconfig, logs) and its containers.

Why a kubeconfig per pod: in-cluster clients look for the token at a fixed path
(/var/run/secrets/...), which local processes cannot share; the Python client, kopf and kubectl
all fall back to ``$KUBECONFIG``, which here holds the pod's own bound service-account token.

Why kwok objects per pod: kwok answers the kubelet API (``kubectl logs``, ``port-forward``,
``exec``) from ``Logs``, ``PortForward`` and ``Exec`` objects named after the pod. The pod owns
them, so they go when it goes. The ``Exec`` environment leaves out values taken from Secrets
(they would otherwise sit in a plain object).
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from .pki import kubeconfig
from .podenv import ConfigError, command_line, container_env
from .podprocess import INHERITED_ENV, LocalContainer, now_iso
from .podvolumes import VolumeNotReady, container_mounts, link_root, path_rewriter, sync_volume_files, volume_dirs
from .runner_rules import image_prefixes

WILDCARDS = ("0.0.0.0", "::", "")
KWOK_GROUP, KWOK_VERSION = "kwok.x-k8s.io", "v1alpha1"
SETUP_RETRY_SECONDS = 2.0  # how often an unbound claim or missing ConfigMap is looked at again
VOLUME_SYNC_SECONDS = 5.0  # how often a running pod's Secret and ConfigMap volumes are synced


def kernel_cache() -> str:
    """Where pods find compiled CPU kernels: the host's build cache, as an image carries its
    kernels prebuilt (HOME is the pod's own /tmp volume, which would rebuild them in every pod)."""
    return os.environ.get("KUBEINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeinfer")


@dataclass
class Apiserver:
    host: str
    port: int
    ca: Path

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"


LWS_NAME, LWS_GROUP = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/group-index"


def lws_leader_ip(core: client.CoreV1Api, pod: dict) -> str | None:
    """A LeaderWorkerSet pod's leader's IP, which LWS_LEADER_ADDRESS names through cluster DNS
    (`<lws>-<group>.<lws>.<namespace>`); this cluster has no DNS, so the runner hands the pod the
    IP instead. None for other pods; not yet scheduled leaders are retried like unbound claims."""
    labels = pod["metadata"].get("labels") or {}
    if LWS_NAME not in labels or LWS_GROUP not in labels:
        return None
    leader = f"{labels[LWS_NAME]}-{labels[LWS_GROUP]}"
    if leader == pod["metadata"]["name"]:
        return (pod.get("status") or {}).get("podIP")
    try:
        ip = core.read_namespaced_pod(leader, pod["metadata"]["namespace"]).status.pod_ip
    except client.ApiException as err:
        raise VolumeNotReady(f"LWS leader pod {leader}: {err.reason}") from None
    if not ip:
        raise VolumeNotReady(f"LWS leader pod {leader} has no IP yet")
    return ip


@dataclass
class LocalPod:
    pod: dict
    dir: Path
    containers: dict[str, LocalContainer] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # container -> CreateContainerConfigError
    lock: threading.Lock = field(default_factory=threading.Lock)
    created: str = field(default_factory=now_iso)
    exec_env: dict[str, dict[str, str]] = field(default_factory=dict)  # container -> env without secrets
    ready_state: tuple[bool, str] = (False, "")  # (ready, lastTransitionTime)
    init_containers: dict[str, LocalContainer] = field(default_factory=dict)
    mounted: bool = False  # volumes set up and containers built
    setup_error: str = ""  # why not yet (an unbound claim, a missing ConfigMap)
    next_setup: float = 0.0
    next_volume_sync: float = 0.0
    stopped: bool = False
    published: bool = False
    core: client.CoreV1Api | None = None
    entrypoint: list[str] = field(default_factory=list)
    pid_dir: Path = Path()
    nodes_dir: Path = Path()
    base_env: dict[str, str] = field(default_factory=dict)
    leader_ip: str | None = None   # a LeaderWorkerSet pod's leader (for LWS_LEADER_ADDRESS)
    previous: list[threading.Thread] = field(default_factory=list)  # stops of pods with this IP or name

    @property
    def ip(self) -> str:
        return self.pod["status"]["podIP"]

    def _service_account(self, core: client.CoreV1Api, api: Apiserver) -> dict[str, str]:
        meta = self.pod["metadata"]
        sa_dir = self.dir / "serviceaccount"
        sa_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(api.ca, sa_dir / "ca.crt")
        (sa_dir / "namespace").write_text(meta["namespace"])
        env = {"KUBERNETES_SERVICE_HOST": api.host, "KUBERNETES_SERVICE_PORT": str(api.port),
               "KUBERNETES_SERVICE_PORT_HTTPS": str(api.port)}
        if self.pod["spec"].get("automountServiceAccountToken") is False:
            return env
        bound_to = {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}  # dies with the pod
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"audiences": [], "expirationSeconds": 24 * 3600, "boundObjectRef": bound_to}}
        sa_name = self.pod["spec"].get("serviceAccountName") or "default"
        token = core.create_namespaced_service_account_token(sa_name, meta["namespace"], request).status.token
        (sa_dir / "token").write_text(token)
        (self.dir / "kubeconfig").write_text(kubeconfig(api.url, sa_dir / "ca.crt", token, sa_name))
        return {**env, "KUBECONFIG": str(self.dir / "kubeconfig")}

    def start(self, core: client.CoreV1Api, api: Apiserver, entrypoint: list[str], pid_dir: Path,
              nodes_dir: Path) -> None:
        """Set the pod up and start its first init container (or its containers); an unbound
        claim defers that to a later ``tick``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.core, self.entrypoint, self.pid_dir, self.nodes_dir = core, entrypoint, pid_dir, nodes_dir
        self.base_env = {**self._service_account(core, api), "HOSTNAME": self.pod["metadata"]["name"],
                         "POD_IP": self.ip, "KUBEINFER_HOST": self.ip, "KUBEINFER_CACHE_DIR": kernel_cache()}
        self._set_up()

    def _set_up(self) -> None:
        """Volumes, then every container of ours (others are simulated), then the first to run."""
        self.next_setup = time.monotonic() + SETUP_RETRY_SECONDS
        if held := self._ip_held():
            self.setup_error = held
            return
        try:
            dirs = volume_dirs(self.core, self.pod, self.dir, self.nodes_dir)
            self.leader_ip = lws_leader_ip(self.core, self.pod)
        except (VolumeNotReady, ConfigError) as err:
            self.setup_error = str(err)
            return
        self.setup_error = ""
        spec = self.pod["spec"]
        restart = spec.get("restartPolicy", "Always")
        for container in spec.get("initContainers") or []:  # a kubelet retries failed ones unless Never
            if local := self._container(container, dirs, "Never" if restart == "Never" else "OnFailure"):
                self.init_containers[container["name"]] = local
        for container in spec["containers"]:
            if local := self._container(container, dirs, restart):
                self.containers[container["name"]] = local
        self.mounted = True
        self._advance()

    def _ip_held(self) -> str:
        """Why this pod cannot have its IP yet, or "". kwok gives a deleted pod's IP to the next
        pod at once, while the runner may still be stopping the old pod's processes (they get
        their grace period); in the one network namespace that all pods share here, those would
        hold the new pod's ports, and its probes would reach them instead of the new pod. A
        namesake (LWS recreates a group's pods under their names) shares the pod directory."""
        if any(stop.is_alive() for stop in self.previous):   # its logs and pid files are this pod's too
            return f"pod IP {self.ip} or this pod's name is still held by a pod before, which is being stopped"
        ports = {p["containerPort"] for c in self.pod["spec"]["containers"]
                 if c.get("image", "").startswith(image_prefixes())
                 for p in c.get("ports") or [] if p.get("protocol", "TCP") == "TCP"}
        for port in sorted(ports):
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((self.ip, port))
                except OSError as err:
                    return f"port {self.ip}:{port} is taken ({err.strerror}) by a process outside this pod"
        return ""

    def _container(self, container: dict, dirs: dict[str, Path], restart: str) -> LocalContainer | None:
        if not container.get("image", "").startswith(image_prefixes()):
            return None
        name, spec = container["name"], self.pod["spec"]
        try:
            secret: set[str] = set()
            own_env = container_env(self.core, self.pod, container, secret)
            mounts = container_mounts(container, dirs)
        except ConfigError as err:
            self.errors[name] = str(err)
            return None
        link_root(self.dir / "root" / name, mounts)
        host_path = path_rewriter(mounts)
        # Only the container's own values are in its view of the filesystem; the runner's (the
        # pod's kubeconfig, the kernel cache) are host paths already, which a mount at /tmp would
        # otherwise rewrite when the cluster itself lives under /tmp.
        env = {**self.base_env, **{key: host_path(value) for key, value in own_env.items()}}
        if env.get("KUBEINFER_HOST") in WILDCARDS:  # one shared network namespace here:
            env["KUBEINFER_HOST"] = self.ip  # a wildcard would take every pod's port
        if self.leader_ip and "LWS_LEADER_ADDRESS" in env:   # no cluster DNS here: the name's pod IP
            env["LWS_LEADER_ADDRESS"] = self.leader_ip
        argv = [host_path(arg) for arg in command_line(container, env, self.entrypoint)]
        inherited = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        self.exec_env[name] = {k: v for k, v in {**inherited, **env}.items() if k not in secret}
        return LocalContainer(container, argv, env, self.dir, self.dir / f"{name}.log", self.ip, restart,
                              float(spec.get("terminationGracePeriodSeconds", 30)),
                              self.pid_dir / f"pod-{self.dir.name}-{name}.pid")

    @property
    def initialized(self) -> bool:
        return self.mounted and all(c["name"] not in self.errors and (
            c["name"] not in self.init_containers or self.init_containers[c["name"]].succeeded)
            for c in self.pod["spec"].get("initContainers") or [])

    def _advance(self) -> None:
        """Start the next init container once the one before succeeded; then the containers."""
        if self.stopped:
            return
        for container in self.pod["spec"].get("initContainers") or []:
            if container["name"] in self.errors:
                return
            local = self.init_containers.get(container["name"])
            if local is None or local.succeeded:
                continue
            if local.proc is None and not local.terminated and not local.next_start:
                local.start()
            return
        for local in self.containers.values():
            if local.proc is None and not local.terminated and not local.next_start:
                local.start()

    def kubelet_targets(self) -> list[tuple[str, dict]]:
        """(plural, body) of the kwok Logs, PortForward and Exec objects for this pod."""
        meta = self.pod["metadata"]
        owner = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
        names = list(self.containers)
        logs = [{"containers": [name], "logsFile": str(local.logs.current), "previousLogsFile":
                 str(local.logs.previous), "follow": True}
                for name, local in (*self.init_containers.items(), *self.containers.items())]
        ports = sorted({p["containerPort"] for c in self.pod["spec"]["containers"] if c["name"] in names
                        for p in c.get("ports") or [] if p.get("protocol", "TCP") == "TCP"})
        forwards = [{"ports": [port], "target": {"address": self.ip, "port": port}} for port in ports]
        execs = [{"containers": [name], "local": {"workDir": str(self.dir), "envs": [
            {"name": k, "value": v} for k, v in sorted(self.exec_env[name].items())]}} for name in names]
        specs = {"logs": {"logs": logs}, "portforwards": {"forwards": forwards}, "execs": {"execs": execs}}
        kinds = {"logs": "Logs", "portforwards": "PortForward", "execs": "Exec"}
        return [(plural, {"apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}", "kind": kinds[plural],
                          "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                                       "ownerReferences": [owner]}, "spec": spec})
                for plural, spec in specs.items() if next(iter(spec.values()))]

    def publish(self, custom: client.CustomObjectsApi) -> None:
        """Create (or take over a dead namesake's) kwok objects for this pod."""
        self.published = True
        for plural, body in self.kubelet_targets():
            namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
            try:
                custom.create_namespaced_custom_object(KWOK_GROUP, KWOK_VERSION, namespace, plural, body)
            except client.ApiException as err:
                if err.status != 409:
                    raise
                custom.patch_namespaced_custom_object(KWOK_GROUP, KWOK_VERSION, namespace, plural, name,
                                                      {"metadata": body["metadata"], "spec": body["spec"]},
                                                      _content_type="application/merge-patch+json")

    def tick(self) -> None:
        with self.lock:
            if not self.mounted:
                if time.monotonic() >= self.next_setup and not self.stopped:
                    self._set_up()
                return
            for container in (*self.init_containers.values(), *self.containers.values()):
                container.tick()
            self._advance()
            if time.monotonic() >= self.next_volume_sync:
                self.next_volume_sync = time.monotonic() + VOLUME_SYNC_SECONDS
                sync_volume_files(self.core, self.pod, self.dir)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for container in (*self.init_containers.values(), *self.containers.values()):
                container.stop()
                container.next_start = 0.0

    def _waiting(self, container: dict, reason: str, message: str = "") -> dict:
        waiting = {"reason": reason, **({"message": message} if message else {})}
        return {"name": container["name"], "image": container.get("image", ""), "ready": False, "restartCount": 0,
                "state": {"waiting": waiting}}

    def _status_of(self, container: dict, local: dict[str, LocalContainer], before: str = "") -> dict:
        """One container's status; ``before``: why it has not started yet (PodInitializing...)."""
        name = container["name"]
        if name in self.errors:
            return self._waiting(container, "CreateContainerConfigError", self.errors[name])
        if not self.mounted:
            return self._waiting(container, "ContainerCreating", self.setup_error)
        if name in local and (local[name].started_iso or not before):
            return local[name].status()
        if before:
            return self._waiting(container, before)
        # not our image: simulated, like kwok does for every other pod
        return {"name": name, "image": container.get("image", ""), "ready": True, "restartCount": 0,
                "started": True, "state": {"running": {"startedAt": self.created}}}

    def _init_statuses(self) -> list[dict]:
        statuses, blocked = [], False
        for container in self.pod["spec"].get("initContainers") or []:
            name = container["name"]
            if container.get("image", "").startswith(image_prefixes()) or name in self.errors:
                status = self._status_of(container, self.init_containers, "PodInitializing" if blocked else "")
                blocked = blocked or name not in self.init_containers or not self.init_containers[name].succeeded
            else:  # not our image: reported Completed, as kwok would
                status = {"name": name, "image": container.get("image", ""), "ready": True, "restartCount": 0,
                          "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                   "startedAt": self.created, "finishedAt": self.created}}}
            statuses.append(status)
        return statuses

    def status(self) -> dict:
        """Pod status fields the runner owns: phase, conditions, init and container statuses."""
        init = self._init_statuses()
        initialized = self.initialized
        statuses = [self._status_of(c, self.containers, "" if initialized else "PodInitializing")
                    for c in self.pod["spec"]["containers"]]
        ready = all(s["ready"] for s in statuses)
        if ready != self.ready_state[0] or not self.ready_state[1]:
            self.ready_state = (ready, now_iso())
        terminated = [s["state"]["terminated"] for s in statuses if "terminated" in s["state"]]
        phase = "Running" if any("running" in s["state"] for s in statuses) else "Pending"
        if terminated and len(terminated) == len(statuses):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in terminated) else "Failed"
        failed_init = [s for s in init if s["state"].get("terminated", {}).get("exitCode", 0) != 0]
        if failed_init and self.pod["spec"].get("restartPolicy") == "Never":
            phase = "Failed"  # a kubelet does not retry init containers of such a pod
        conditions = [{"type": kind, "status": str(ready), "lastTransitionTime": self.ready_state[1],
                       "reason": None if ready else "ContainersNotReady"}
                      for kind in ("Ready", "ContainersReady")]
        conditions.append({"type": "Initialized", "status": str(initialized), "lastTransitionTime": self.created,
                           "reason": None if initialized else "ContainersNotInitialized"})
        return {"phase": phase, "conditions": conditions, "containerStatuses": statuses,
                "initContainerStatuses": init}
