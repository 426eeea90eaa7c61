"""Local pod runner: kubeinfer's own pods on the fake nodes run as real local processes.

Test and demo infrastructure, not product. kwok only simulates pod status; for a pod that is
bound to a local node, has its (loopback) pod IP and uses one of kubeinfer's images
(``runner_rules``), this starts each container's command with its env, a bound service-account
token and ``KUBERNETES_SERVICE_HOST/PORT`` of the local apiserver; sets ``KUBEINFER_HOST`` to the
pod IP (also over a wildcard the pod sets: all pods share one network namespace here) so
``kubeinfer serve`` binds there; restarts per restartPolicy;
reflects probes into Ready/ContainersReady and containerStatuses; stops the process group when
the pod goes away. Init containers run in order before the containers, retried with back-off
unless restartPolicy is Never (then the pod fails); volumes are host directories that the
containers' mount paths are rewritten to (podvolumes.py). Logs: ``<state>/pods/<namespace>_<pod>/<container>.log``, and in the
CRI format under ``…/cri/`` for ``kubectl logs``, which reaches them (and ``exec``,
``port-forward``) through kwok's kubelet API and the kwok objects each pod gets (localpod.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from pathlib import Path

from kubernetes import client, config, watch

from . import provisioner
from .localpod import Apiserver, LocalPod
from .runner_rules import runner_managed

log = logging.getLogger("podrunner")


class Runner:
    def __init__(self, core: client.CoreV1Api, api: Apiserver, state: Path, pid_dir: Path, node_selector: str,
                 entrypoint: list[str], nodes_dir: Path):
        self.core, self.api, self.state, self.pid_dir, self.nodes_dir = core, api, state, pid_dir, nodes_dir
        self.node_selector, self.entrypoint = node_selector, entrypoint
        self.pods: dict[str, LocalPod] = {}
        self.reported: dict[str, dict] = {}
        # pod IP, and pod directory (a namesake: LWS recreates a group's pods under their
        # names) -> the stop of the pod that had it
        self.releasing: dict[str, threading.Thread] = {}
        self.stopping = threading.Event()

    def local_nodes(self) -> set[str]:
        return {n.metadata.name for n in self.core.list_node(label_selector=self.node_selector).items}

    def reconcile(self, kind: str, pod: dict, nodes: set[str]) -> None:
        uid, meta, status = pod["metadata"]["uid"], pod["metadata"], pod.get("status") or {}
        wanted = (kind != "DELETED" and not meta.get("deletionTimestamp") and pod["spec"].get("nodeName") in nodes
                  and runner_managed(pod) and status.get("podIP"))
        if not wanted:
            if uid in self.pods:
                local = self.pods.pop(uid)
                log.info("stopping %s/%s", meta["namespace"], meta["name"])
                stopper = threading.Thread(target=local.stop, daemon=False)
                stopper.start()
                self.releasing = {ip: t for ip, t in self.releasing.items() if t.is_alive()}
                self.releasing[local.ip] = self.releasing[local.dir.name] = stopper
            return
        if uid not in self.pods and status.get("phase") not in ("Succeeded", "Failed"):
            pod_dir = self.state / f"{meta['namespace']}_{meta['name']}"
            previous = [t for key in (status["podIP"], pod_dir.name) if (t := self.releasing.get(key))]
            local = LocalPod(pod, pod_dir, previous=previous)
            log.info("starting %s/%s on %s", meta["namespace"], meta["name"], local.ip)
            # supervised only once started: a tick before that would set the pod up without its
            # environment (service-account token, API server) and start its containers twice
            local.start(self.core, self.api, self.entrypoint, self.pid_dir, self.nodes_dir)
            self.pods[uid] = local
        elif uid in self.pods:
            self.pods[uid].pod = pod

    def publish(self, local: LocalPod) -> None:
        meta = local.pod["metadata"]
        try:
            local.publish(client.CustomObjectsApi(self.core.api_client))
        except client.ApiException as err:  # the pod runs; only kubectl logs/exec/port-forward miss it
            log.warning("kwok objects for %s/%s: %s", meta["namespace"], meta["name"], err.reason)

    def watch(self) -> None:
        """List then watch all pods; on any error (e.g. 410 Gone) list again."""
        while not self.stopping.is_set():
            try:
                nodes = self.local_nodes()
                listing = json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False).data)
                for pod in listing["items"]:
                    self.reconcile("ADDED", pod, nodes)
                for uid in set(self.pods) - {p["metadata"]["uid"] for p in listing["items"]}:
                    self.reconcile("DELETED", self.pods[uid].pod, nodes)
                stream = watch.Watch().stream(self.core.list_pod_for_all_namespaces, timeout_seconds=60,
                                              resource_version=listing["metadata"]["resourceVersion"])
                for event in stream:
                    if event["type"] == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                        break
                    self.reconcile(event["type"], event["raw_object"], nodes)
            except Exception:  # noqa: BLE001 - the runner must outlive apiserver hiccups
                log.exception("watch failed; relisting")
                time.sleep(1)

    def supervise(self, interval: float = 0.5) -> None:
        """Tick every local pod and patch its status when it changed. One pod's error is logged
        and that pod tried again on the next tick: the thread that runs every pod's probes and
        restarts must not end with it (every pod would then stay as last reported)."""
        while not self.stopping.wait(interval):
            for uid, local in list(self.pods.items()):
                try:
                    self.supervise_one(uid, local)
                except Exception:  # noqa: BLE001
                    meta = local.pod["metadata"]
                    log.exception("supervising %s/%s failed; trying again", meta["namespace"], meta["name"])

    def supervise_one(self, uid: str, local: LocalPod) -> None:
        local.tick()
        if local.mounted and not local.published:
            self.publish(local)
        status = local.status()
        if self.reported.get(uid) == status:
            return
        meta = local.pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status},
                                                  _content_type="application/strategic-merge-patch+json")
            self.reported[uid] = status
        except client.ApiException as err:
            if err.status != 404:
                log.warning("status patch for %s/%s failed: %s", meta["namespace"], meta["name"], err.reason)

    def shutdown(self, *_: object) -> None:
        self.stopping.set()
        for local in self.pods.values():
            local.stop()
        raise SystemExit(0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.localcluster.podrunner", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--nodes-dir", type=Path, required=True,
                        help="each node's root for hostPath volumes (<dir>/<node>/<path>)")
    parser.add_argument("--volumes-dir", type=Path, required=True,
                        help="where the local-path provisioner puts claims' volumes (e2e/localcluster/provisioner.py)")
    parser.add_argument("--pid-dir", type=Path, required=True, help="where process pids are recorded for `down`")
    parser.add_argument("--node-selector", default="type=kwok", help="label selector of the local fake nodes")
    parser.add_argument("--entrypoint", default="kubeinfer", help="command for containers that set none")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    api_client = config.new_client_from_config(config_file=args.kubeconfig)
    host, port = api_client.configuration.host.removeprefix("https://").rsplit(":", 1)
    api = Apiserver(host, int(port), Path(api_client.configuration.ssl_ca_cert))
    runner = Runner(client.CoreV1Api(api_client), api, args.state_dir, args.pid_dir, args.node_selector,
                    args.entrypoint.split(), args.nodes_dir)
    signal.signal(signal.SIGTERM, runner.shutdown)
    signal.signal(signal.SIGINT, runner.shutdown)
    threading.Thread(target=runner.supervise, daemon=True).start()
    threading.Thread(target=provisioner.run, args=(runner.core, args.volumes_dir, runner.stopping), daemon=True).start()
    runner.watch()


if __name__ == "__main__":
    main()
