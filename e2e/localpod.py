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
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client

from e2e.pki import kubeconfig
from e2e.podenv import ConfigError, command_line, container_env
from e2e.podprocess import INHERITED_ENV, LocalContainer, now_iso
from e2e.runner_rules import image_prefixes

WILDCARDS = ("0.0.0.0", "::", "")
KWOK_GROUP, KWOK_VERSION = "kwok.x-k8s.io", "v1alpha1"


@dataclass
class Apiserver:
    host: str
    port: int
    ca: Path

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"


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

    def start(self, core: client.CoreV1Api, api: Apiserver, entrypoint: list[str], pid_dir: Path) -> None:
        """Start every container whose image is ours; other containers are reported as running."""
        self.dir.mkdir(parents=True, exist_ok=True)
        base = {**self._service_account(core, api), "HOSTNAME": self.pod["metadata"]["name"],
                "POD_IP": self.ip, "KUBEINFER_HOST": self.ip}
        spec = self.pod["spec"]
        for container in spec["containers"]:
            if not container.get("image", "").startswith(image_prefixes()):
                continue
            try:
                secret: set[str] = set()
                env = {**base, **container_env(core, self.pod, container, secret)}
                if env.get("KUBEINFER_HOST") in WILDCARDS:  # one shared network namespace here:
                    env["KUBEINFER_HOST"] = self.ip  # a wildcard would take every pod's port
            except ConfigError as err:
                self.errors[container["name"]] = str(err)
                continue
            inherited = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
            self.exec_env[container["name"]] = {k: v for k, v in {**inherited, **env}.items() if k not in secret}
            local = LocalContainer(container, command_line(container, env, entrypoint), env, self.dir,
                                   self.dir / f"{container['name']}.log", self.ip, spec.get("restartPolicy", "Always"),
                                   float(spec.get("terminationGracePeriodSeconds", 30)),
                                   pid_dir / f"pod-{self.dir.name}-{container['name']}.pid")
            self.containers[container["name"]] = local
            local.start()

    def kubelet_targets(self) -> list[tuple[str, dict]]:
        """(plural, body) of the kwok Logs, PortForward and Exec objects for this pod."""
        meta = self.pod["metadata"]
        owner = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
        names = list(self.containers)
        logs = [{"containers": [name], "logsFile": str(local.logs.current), "previousLogsFile":
                 str(local.logs.previous), "follow": True} for name, local in self.containers.items()]
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
            for container in self.containers.values():
                container.tick()

    def stop(self) -> None:
        with self.lock:
            for container in self.containers.values():
                container.stop()
                container.next_start = 0.0

    def status(self) -> dict:
        """Pod status fields the runner owns: phase, Ready/ContainersReady, containerStatuses."""
        statuses = []
        for container in self.pod["spec"]["containers"]:
            name = container["name"]
            if name in self.containers:
                statuses.append(self.containers[name].status())
            elif name in self.errors:
                statuses.append({"name": name, "image": container.get("image", ""), "ready": False, "restartCount": 0,
                                 "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                       "message": self.errors[name]}}})
            else:  # not our image: simulated, like kwok does for every other pod
                statuses.append({"name": name, "image": container.get("image", ""), "ready": True, "restartCount": 0,
                                 "started": True, "state": {"running": {"startedAt": self.created}}})
        ready = all(s["ready"] for s in statuses)
        if ready != self.ready_state[0] or not self.ready_state[1]:
            self.ready_state = (ready, now_iso())
        terminated = [s["state"]["terminated"] for s in statuses if "terminated" in s["state"]]
        phase = "Running" if any("running" in s["state"] for s in statuses) else "Pending"
        if terminated and len(terminated) == len(statuses):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in terminated) else "Failed"
        conditions = [{"type": kind, "status": str(ready), "lastTransitionTime": self.ready_state[1],
                       "reason": None if ready else "ContainersNotReady"}
                      for kind in ("Ready", "ContainersReady")]
        init = [{"name": c["name"], "image": c.get("image", ""), "ready": True, "restartCount": 0,
                 "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": self.created,
                                          "finishedAt": self.created}}}
                for c in self.pod["spec"].get("initContainers") or []]  # simulated, not run (see podrunner)
        return {"phase": phase, "conditions": conditions, "containerStatuses": statuses,
                "initContainerStatuses": init}
