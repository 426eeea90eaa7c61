"""The real LeaderWorkerSet controller (sigs.k8s.io/lws) on the local cluster, started on demand.

Only tests of multi-pod InferenceServices ask for it (the ``lws`` fixture), so other runs
neither build nor start it. What it needs here, done by ``start``:

- its CRD (1.2 MB: applied server-side, too big for a client-side apply's annotation);
- kube-controller-manager (already part of the cluster: LWS makes a StatefulSet per group);
- its webhooks: the pod webhook sets the group labels and injects LWS_LEADER_ADDRESS,
  LWS_GROUP_SIZE and LWS_WORKER_INDEX, so LWS does not work without it. Its own certificate
  management is off (``internalCertManagement.enable: false``); it serves a certificate from
  the cluster's CA on 127.0.0.1, and the webhook configurations name that URL with the CA as
  ``caBundle``.
"""
from __future__ import annotations

import base64
import copy
import subprocess
from pathlib import Path

import yaml

from . import binaries, processes
from .config import ClusterConfig
from .health import http_ok, wait_until

NAME = "lws-controller"
CRD = "leaderworkersets.leaderworkerset.x-k8s.io"


def ports(cfg: ClusterConfig) -> dict[str, int]:
    """Loopback ports below the service proxy's range (which starts at base + 10)."""
    return {"webhook": cfg.port_base + 6, "metrics": cfg.port_base + 7, "health": cfg.port_base + 8}


def _certificate(pki_dir: Path, out: Path) -> None:
    """tls.crt / tls.key for 127.0.0.1, signed by the cluster's CA (controller-runtime's certDir names)."""
    out.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=out, check=True, capture_output=True)

    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=lws-webhook")
    (out / "tls.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", str(pki_dir / "ca.crt"), "-CAkey", str(pki_dir / "ca.key"),
            "-CAcreateserial", "-days", "3650", "-extfile", "tls.ext", "-out", "tls.crt")


def _configuration(cfg: ClusterConfig, cert_dir: Path) -> dict:
    port = ports(cfg)
    return {"apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": port["webhook"], "host": "127.0.0.1", "certDir": str(cert_dir)},
            "metrics": {"bindAddress": f"127.0.0.1:{port['metrics']}"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{port['health']}"}}


def webhook_configurations(manifests: str, url: str, ca: bytes) -> list[dict]:
    """LWS's own webhook configurations (config/webhook of the module), each service reference
    turned into a URL on loopback with the CA bundle; the pod webhooks only see LWS's pods (the
    objectSelector its kustomize patches add), so a stopped controller never blocks other pods."""
    objects = [copy.deepcopy(doc) for doc in yaml.safe_load_all(manifests) if doc]
    for obj in objects:
        obj["metadata"]["name"] = f"kubeinfer-local-lws-{obj['kind'].removesuffix('WebhookConfiguration').lower()}"
        for hook in obj["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url}{path}", "caBundle": base64.b64encode(ca).decode()}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = {"matchExpressions": [
                    {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
    return objects


def running(cfg: ClusterConfig) -> bool:
    return NAME in processes.running(cfg.state_dir) and http_ok(f"http://127.0.0.1:{ports(cfg)['health']}/readyz")


def start(cfg: ClusterConfig, kubectl) -> None:
    """Build (once), install and start LWS on this cluster unless it runs already; `kubectl(*args,
    stdin=...)` runs kubectl against it. `down` stops it with the rest of the cluster."""
    if running(cfg):
        return
    out = binaries.ensure("lws")
    state = cfg.state_dir / "lws"
    cert_dir = state / "certs"
    _certificate(cfg.state_dir / "pki", cert_dir)
    config_file = state / "config.yaml"
    config_file.write_text(yaml.safe_dump(_configuration(cfg, cert_dir)))
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(out / "leaderworkersets.yaml"))
    established = '{.status.conditions[?(@.type=="Established")].status}'
    wait_until(lambda: kubectl("get", "crd", CRD, "-o", f"jsonpath={established}", check=False).stdout == "True",
               f"CRD {CRD} established", timeout=60, interval=0.5)
    pid = processes.spawn(NAME, [str(out / NAME), f"--config={config_file}"], cfg.state_dir,
                          env={"KUBECONFIG": str(cfg.kubeconfig)})
    wait_until(lambda: http_ok(f"http://127.0.0.1:{ports(cfg)['health']}/readyz"), NAME, timeout=60,
               alive=lambda: processes.pid_alive(pid))
    manifests = (binaries.lws_module_dir() / "config/webhook/manifests.yaml").read_text()
    url = f"https://127.0.0.1:{ports(cfg)['webhook']}"
    hooks = webhook_configurations(manifests, url, (cfg.state_dir / "pki" / "ca.crt").read_bytes())
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=yaml.safe_dump_all(hooks))
