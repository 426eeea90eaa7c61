"""kubectl's pod verbs on the local cluster reach the runner's processes through kwok's kubelet
API (logs, logs -f, --previous, exec, port-forward to a pod and to a Service), and every Service
is reachable from this machine through the local service proxy, taking turns between pods."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from e2e.localcluster import svcproxy
from e2e.helpers import Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
IMAGE = "kubeinfer/kubeinfer:e2e"


def web(name: str, labels: dict[str, str] | None = None) -> dict:
    """A pod answering GET / with its own name on its pod IP."""
    script = ('import http.server, os\n'
              'class H(http.server.BaseHTTPRequestHandler):\n'
              '    def do_GET(self):\n'
              '        body = os.environ["POD_NAME"].encode()\n'
              '        self.send_response(200); self.send_header("Content-Length", str(len(body)))\n'
              '        self.end_headers(); self.wfile.write(body)\n'
              'print("serving", os.environ["POD_NAME"], flush=True)\n'
              'http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()\n')
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {"app": name}},
            "spec": {"terminationGracePeriodSeconds": 2, "containers": [{
                "name": "web", "image": IMAGE, "command": ["python", "-c", script],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}]}}


def ready(cluster: Cluster, namespace: str, name: str) -> None:
    wait_for(lambda: pod_ready(cluster.core.read_namespaced_pod(name, namespace)), f"pod {name} Ready", timeout=60)


@contextmanager
def port_forward(cluster: Cluster, namespace: str, target: str, port: int) -> Iterator[int]:
    """`kubectl port-forward <target> :<port>`; yields the local port kubectl picked."""
    proc = subprocess.Popen(["kubectl", f"--kubeconfig={cluster.kubeconfig}", "-n", namespace, "port-forward",
                             target, f":{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(60, proc.kill)  # kubectl saying nothing fails the test instead of hanging it
    watchdog.start()
    try:
        line = proc.stdout.readline()
        watchdog.cancel()
        match = re.match(r"Forwarding from 127\.0\.0\.1:(\d+) ->", line)
        assert match, f"kubectl port-forward said: {line}{proc.stdout.read() if proc.poll() is not None else ''}"
        yield int(match.group(1))
    finally:
        proc.terminate()
        proc.wait(10)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_kubectl_logs_and_previous(local_cluster: Cluster, namespace: str) -> None:
    script = "import sys, time; print('run x', flush=True); " \
             "print('to stderr', file=sys.stderr, flush=True); time.sleep(2); sys.exit(1)"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker"},
           "spec": {"terminationGracePeriodSeconds": 1, "containers": [
               {"name": "main", "image": IMAGE, "command": ["python", "-c", script]}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)
    logs = wait_for(lambda: local_cluster.kubectl("logs", "-n", namespace, "talker", check=False).stdout,
                    "kubectl logs output", timeout=30)
    assert "run x" in logs and "to stderr" in logs, logs
    wait_for(lambda: (statuses := local_cluster.core.read_namespaced_pod("talker", namespace).status
                      .container_statuses) and statuses[0].last_state.terminated, "a terminated run", timeout=60)
    previous = local_cluster.kubectl("logs", "-n", namespace, "talker", "--previous").stdout
    assert previous.splitlines() in (["run x", "to stderr"], ["to stderr", "run x"]), previous


def test_kubectl_logs_follow_streams_new_lines(local_cluster: Cluster, namespace: str) -> None:
    script = "import itertools, time\nfor n in itertools.count():\n    print('tick', n, flush=True); time.sleep(0.3)"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ticker"},
           "spec": {"terminationGracePeriodSeconds": 1, "containers": [
               {"name": "main", "image": IMAGE, "command": ["python", "-c", script]}]}}
    local_cluster.core.create_namespaced_pod(namespace, pod)
    wait_for(lambda: local_cluster.kubectl("logs", "-n", namespace, "ticker", check=False).stdout,
             "the first tick", timeout=30)
    follow = subprocess.Popen(["kubectl", f"--kubeconfig={local_cluster.kubeconfig}", "-n", namespace, "logs",
                               "-f", "--tail=1", "ticker"], stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, follow.kill)  # a stuck stream fails the test instead of hanging it
    watchdog.start()
    try:
        ticks = [int(follow.stdout.readline().split()[1]) for _ in range(4)]
    finally:
        watchdog.cancel()
        follow.terminate()
        follow.wait(10)
    assert ticks == list(range(ticks[0], ticks[0] + 4)), ticks  # lines written after kubectl started


def test_kubectl_exec_runs_in_the_pods_directory_and_env(local_cluster: Cluster, namespace: str) -> None:
    local_cluster.core.create_namespaced_pod(namespace, web("web"))
    ready(local_cluster, namespace, "web")
    ip = local_cluster.core.read_namespaced_pod("web", namespace).status.pod_ip
    out = local_cluster.kubectl("exec", "-n", namespace, "web", "--", "sh", "-c",
                                'echo "$POD_IP $POD_NAME"; pwd; kubeinfer --help >/dev/null && echo cli').stdout
    assert out.splitlines()[0] == f"{ip} web", out
    assert out.splitlines()[1].endswith(f"{namespace}_web") and out.splitlines()[2] == "cli", out
    failed = local_cluster.kubectl("exec", "-n", namespace, "web", "--", "sh", "-c", "exit 7", check=False)
    # kwok reports a command's failure as an error naming its status, not as the exit code itself
    assert failed.returncode != 0 and "exit status 7" in failed.stderr, failed.stderr


def test_port_forward_to_a_pod_and_a_service(local_cluster: Cluster, namespace: str) -> None:
    local_cluster.core.create_namespaced_pod(namespace, web("web"))
    local_cluster.core.create_namespaced_service(namespace, {
        "metadata": {"name": "web"}, "spec": {"selector": {"app": "web"},
                                               "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    ready(local_cluster, namespace, "web")
    with port_forward(local_cluster, namespace, "pod/web", 8080) as port:
        assert get(f"http://127.0.0.1:{port}/") == "web"
    with port_forward(local_cluster, namespace, "svc/web", 80) as port:
        assert get(f"http://127.0.0.1:{port}/") == "web"


def test_service_answers_from_this_machine_taking_turns(local_cluster: Cluster, namespace: str) -> None:
    for name in ("one", "two"):
        local_cluster.core.create_namespaced_pod(namespace, web(name, {"app": "pair"}))
    local_cluster.core.create_namespaced_service(namespace, {
        "metadata": {"name": "pair"}, "spec": {"selector": {"app": "pair"},
                                                "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
    for name in ("one", "two"):
        ready(local_cluster, namespace, name)
    table = local_cluster.config.service_table
    wait_for(lambda: any(r["namespace"] == namespace and r["name"] == "pair" and len(r["endpoints"]) == 2
                         for r in svcproxy.read_table(table)), "both pods behind the proxied Service", timeout=30)
    url = svcproxy.local_url(table, namespace, "pair")
    assert {get(url + "/") for _ in range(4)} == {"one", "two"}
    status = subprocess.run([sys.executable, "-m", "e2e.localcluster", "status"], capture_output=True, text=True,
                            check=True).stdout
    assert f"{namespace}/pair:80" in status and url in status, status
    local_cluster.core.delete_namespaced_pod("one", namespace, grace_period_seconds=0)
    wait_for(lambda: [r for r in svcproxy.read_table(table) if r["namespace"] == namespace
                      and r["name"] == "pair" and len(r["endpoints"]) == 1], "one pod left", timeout=30)
    time.sleep(0.1)
    assert {get(url + "/") for _ in range(3)} == {"two"}
