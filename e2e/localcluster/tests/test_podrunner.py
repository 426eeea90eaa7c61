"""The local pod runner runs kubeinfer-image pods as real processes on their loopback pod IP."""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from e2e.helpers import Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e

IMAGE = "kubeinfer/kubeinfer:e2e"  # our image prefix: the runner starts the command locally


def http_server_pod(name: str, gate: Path | None = None) -> dict:
    """A pod serving HTTP on its pod IP, with a readiness probe; with ``gate``, it serves only once
    that file exists, so a test decides when the probe can first pass (no race with a timer)."""
    wait = f"until [ -e {gate} ]; do sleep 0.1; done; " if gate else ""
    script = f"{wait}exec python -m http.server 8080 --bind $POD_IP"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                "name": "web", "image": IMAGE, "command": ["sh", "-c", script],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}]}}


def test_runner_starts_process_on_pod_ip_and_gates_ready_on_probe(
        local_cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    gate = tmp_path / "serve"
    local_cluster.core.create_namespaced_pod(namespace, http_server_pod("web", gate))
    read = lambda: local_cluster.core.read_namespaced_pod("web", namespace)  # noqa: E731
    wait_for(lambda: read().status.phase == "Running", "pod web Running", timeout=30)
    time.sleep(3)  # three probe periods that must all fail: nothing listens yet
    assert not pod_ready(read()), "kwok must not mark a runner pod Ready before its probe passes"
    gate.touch()
    pod = wait_for(lambda: pod_ready(p := read()) and p, "pod web Ready", timeout=30)
    status = pod.status.container_statuses[0]
    assert status.ready and status.state.running and status.container_id.startswith("local://")
    with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8080/", timeout=5) as response:
        assert response.status == 200
    pid = int(status.container_id.removeprefix("local://"))
    assert os.path.exists(f"/proc/{pid}")
    local_cluster.core.delete_namespaced_pod("web", namespace)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"process {pid} to stop", timeout=30)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_runner_restarts_a_crashing_container(local_cluster: Cluster, namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crash"},
           "spec": {"restartPolicy": "Always", "containers": [
               {"name": "main", "image": IMAGE, "command": ["python", "-c", "import sys; sys.exit(3)"]}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)

    def restarted():
        statuses = local_cluster.core.read_namespaced_pod("crash", namespace).status.container_statuses or []
        return next((s for s in statuses if s.restart_count >= 1 and s.last_state.terminated), None)

    status = wait_for(restarted, "a restart of container main", timeout=30)
    assert status.last_state.terminated.exit_code == 3
    assert not status.ready


def test_runner_reports_completion_for_restart_never(local_cluster: Cluster, namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "once"},
           "spec": {"restartPolicy": "Never", "containers": [
               {"name": "main", "image": IMAGE, "command": ["python", "-c", "print('done')"]}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: local_cluster.core.read_namespaced_pod("once", namespace).status.phase == "Succeeded",
             "pod once Succeeded", timeout=30)


def test_kubeinfer_serve_pod_answers_on_its_pod_ip(local_cluster: Cluster, namespace: str) -> None:
    """The engine pod as the operator builds it in spirit: image entrypoint `kubeinfer`, host
    from the runner's KUBEINFER_HOST, readiness on /ready. The embedded model loads on the CPU."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "engine"},
           "spec": {"terminationGracePeriodSeconds": 10, "containers": [{
               "name": "engine", "image": IMAGE, "args": ["serve", "--port", "8000"],
               "env": [{"name": "KUBEINFER_KV_CACHE_MEMORY", "value": "64Mi"},
                       {"name": "KUBEINFER_MAX_NUM_SEQS", "value": "4"}],
               "ports": [{"name": "http", "containerPort": 8000}],
               "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2}}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)
    ready = wait_for(lambda: pod_ready(p := local_cluster.core.read_namespaced_pod("engine", namespace)) and p,
                     "the kubeinfer serve pod to pass its readiness probe", timeout=600, interval=2)
    with urllib.request.urlopen(f"http://{ready.status.pod_ip}:8000/v1/models", timeout=10) as response:
        models = json.load(response)
    assert models["object"] == "list"
    assert [m["object"] for m in models["data"]] == ["model"]


def test_runner_gives_env_refs_and_a_service_account_identity(local_cluster: Cluster, namespace: str) -> None:
    core = local_cluster.core
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"key": "s3cret"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"MODE": "fast"}})
    script = ("echo name=$POD_NAME ip=$POD_IP secret=$TOKEN mode=$MODE port=$KUBERNETES_SERVICE_PORT; "
              "kubectl auth whoami -o jsonpath='user={.status.userInfo.username}'")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "envcheck"},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "main", "image": IMAGE, "command": ["sh", "-c", script],
               "envFrom": [{"configMapRef": {"name": "settings"}}],
               "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                       {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                       {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "key"}}}]}]}}
    core.create_namespaced_pod(namespace, pod)
    done = wait_for(lambda: (p := core.read_namespaced_pod("envcheck", namespace)).status.phase == "Succeeded" and p,
                    "pod envcheck Succeeded", timeout=60)
    log = (local_cluster.config.state_dir / "pods" / f"{namespace}_envcheck" / "main.log").read_text()
    port = local_cluster.config.ports["kube-apiserver"]
    assert f"name=envcheck ip={done.status.pod_ip} secret=s3cret mode=fast port={port}" in log
    assert f"user=system:serviceaccount:{namespace}:default" in log


def test_failing_liveness_probe_restarts_the_container(local_cluster: Cluster, namespace: str) -> None:
    pod = http_server_pod("unhealthy")
    container = pod["spec"]["containers"][0]
    container["livenessProbe"] = {"httpGet": {"path": "/", "port": 9}, "periodSeconds": 1, "failureThreshold": 2}
    local_cluster.core.create_namespaced_pod(namespace, pod)

    def restarted():
        statuses = local_cluster.core.read_namespaced_pod("unhealthy", namespace).status.container_statuses or []
        return next((s for s in statuses if s.restart_count >= 1), None)

    status = wait_for(restarted, "a liveness restart", timeout=60)
    assert status.last_state.terminated.exit_code == 137


def test_init_containers_and_volumes_run_as_on_a_node(local_cluster: Cluster, namespace: str) -> None:
    """An init container fills a claim (bound by the local-path provisioner) and a hostPath and
    leaves a termination message; the container reads them, a ConfigMap's file and its emptyDir
    at their mount paths."""
    core, state = local_cluster.core, local_cluster.config.state_dir
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}})
    core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    node_dir = f"/var/cache/{namespace}"  # the node's directory outlives the test
    mounts = [{"name": "data", "mountPath": "/data"}, {"name": "node", "mountPath": "/var/cache/node"},
              {"name": "cfg", "mountPath": "/etc/cfg"}, {"name": "scratch", "mountPath": "/scratch"}]
    fill = ("echo filled > /data/weights && echo $HOSTNAME >> /var/cache/node/seen && "
            "echo '{\"filled\": 1}' > ${KUBEINFER_TERMINATION_LOG:-/dev/termination-log}")
    show = "cat /data/weights /etc/cfg/greeting /var/cache/node/seen; touch /scratch/x; exec sleep 300"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "volumes"}, "spec": {
        "terminationGracePeriodSeconds": 2,
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                    {"name": "node", "hostPath": {"path": node_dir, "type": "DirectoryOrCreate"}},
                    {"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "scratch", "emptyDir": {}}],
        "initContainers": [{"name": "fill", "image": IMAGE, "command": ["sh", "-c", fill], "volumeMounts": mounts}],
        "containers": [{"name": "main", "image": IMAGE, "command": ["sh", "-c", show], "volumeMounts": mounts}]}}
    core.create_namespaced_pod(namespace, pod)
    running = wait_for(lambda: (p := core.read_namespaced_pod("volumes", namespace)).status.phase == "Running" and p,
                       "pod volumes Running", timeout=60)
    filled = running.status.init_container_statuses[0].state.terminated
    assert filled.reason == "Completed" and filled.message == '{"filled": 1}'  # its termination message file
    assert any(c.type == "Initialized" and c.status == "True" for c in running.status.conditions)
    claim = core.read_namespaced_persistent_volume_claim("data", namespace)
    assert claim.status.phase == "Bound"
    assert (state / "volumes" / claim.spec.volume_name / "weights").read_text() == "filled\n"
    log = state / "pods" / f"{namespace}_volumes" / "main.log"
    wait_for(lambda: "hello" in log.read_text(), "the container's output", timeout=30)
    assert "filled\nhellovolumes\n" in log.read_text()  # the ConfigMap's value has no newline
    assert (state / "nodes" / running.spec.node_name / node_dir.lstrip("/") / "seen").read_text() == "volumes\n"


def test_failing_init_container_shows_init_error_with_its_message(local_cluster: Cluster, namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "initfail"}, "spec": {
        "restartPolicy": "Never",
        "initContainers": [{"name": "fetch", "image": IMAGE, "terminationMessagePolicy": "FallbackToLogsOnError",
                            "command": ["sh", "-c", "echo 'revision nope not found' >&2; exit 2"]}],
        "containers": [{"name": "main", "image": IMAGE, "command": ["sleep", "300"]}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)
    failed = wait_for(lambda: (p := local_cluster.core.read_namespaced_pod("initfail", namespace)).status.phase
                      == "Failed" and p, "pod initfail Failed", timeout=60)
    terminated = failed.status.init_container_statuses[0].state.terminated
    assert terminated.exit_code == 2 and "revision nope not found" in terminated.message
    shown = local_cluster.kubectl("get", "pod", "initfail", "-n", namespace, "--no-headers").stdout.split()
    assert shown[2] == "Init:Error"


def test_a_containers_other_processes_end_with_its_first(local_cluster: Cluster, namespace: str,
                                                          tmp_path: Path) -> None:
    """As a container runtime does: when the container's first process exits, what it started
    goes too (here it would live on and hold ports of the pod IP that the next pod gets)."""
    child = tmp_path / "child.pid"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "forks"},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "main", "image": IMAGE,
               "command": ["sh", "-c", f"sleep 600 & echo $! > {child}.tmp && mv {child}.tmp {child}; exit 3"]}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)
    done = wait_for(lambda: (p := local_cluster.core.read_namespaced_pod("forks", namespace)).status.phase == "Failed"
                    and p, "pod forks Failed", timeout=30)
    assert done.status.container_statuses[0].state.terminated.exit_code == 3
    pid = int(child.read_text())
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"the container's child {pid} to end",
             timeout=10)


def test_a_pod_whose_port_is_taken_on_its_ip_waits_for_it(local_cluster: Cluster, namespace: str,
                                                            tmp_path: Path) -> None:
    """kwok hands a deleted pod's IP to the next pod at once, while the pod before may still be
    in its grace period on it. Here the test holds port 8080 on every free IP of a node's pod
    range: a pod on that node waits, saying why, and once the port is free serves itself (its
    probe never passes on the other process's answers)."""
    node = local_cluster.core.list_node(label_selector="type=kwok").items[0]
    squatters = []
    for ip in ipaddress.ip_network(node.spec.pod_cidr).hosts():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((str(ip), 8080))
            sock.listen()
            squatters.append(sock)
        except OSError:   # a running pod's port: its IP is not free
            sock.close()
    try:
        (tmp_path / "who").write_text("the pod")
        pod = http_server_pod("late")
        pod["spec"]["nodeName"] = node.metadata.name
        pod["spec"]["containers"][0]["command"] = [
            "sh", "-c", f"cd {tmp_path} && exec python -m http.server 8080 --bind $POD_IP"]
        local_cluster.core.create_namespaced_pod(namespace, pod)
        read = lambda: local_cluster.core.read_namespaced_pod("late", namespace)  # noqa: E731
        waiting = wait_for(lambda: (s := read().status.container_statuses) and s[0].state.waiting
                           and s[0].state.waiting.message and s[0].state.waiting, "late's waiting reason", timeout=30)
        assert waiting.reason == "ContainerCreating", waiting
        assert f"{read().status.pod_ip}:8080 is taken" in waiting.message, waiting
    finally:
        for sock in squatters:
            sock.close()
    ip = wait_for(lambda: pod_ready(p := read()) and p, "pod late Ready", timeout=60).status.pod_ip
    with urllib.request.urlopen(f"http://{ip}:8080/who", timeout=5) as response:
        assert response.read() == b"the pod"
