"""Command lines of the control-plane processes, cross-checked with ``kwokctl --dry-run``.

Why these flags: no default route exists here, so the apiserver gets explicit bind/advertise
addresses and no endpoint reconciler; the controller-manager runs only the controllers a
workload needs (no node lifecycle: kwok owns node health, so the admission plugin that taints
new nodes not-ready until that controller clears it is off), with per-controller service-account
credentials so RBAC is exercised the way a real cluster does. No endpointslice controller:
the API rejects loopback addresses in every EndpointSlice (``may not be in the loopback
range``), so it could only post a warning per Service; the local service proxy
(e2e/localcluster/svcproxy.py) picks a Service's Ready pods itself.

kwok also plays each node's kubelet API (logs, exec, port-forward) on its server port, which
the nodes advertise as their kubelet port; the per-pod targets are kwok's ``Logs``,
``PortForward`` and ``Exec`` objects that the pod runner writes (e2e/localcluster/kwok/README.md).
"""
from __future__ import annotations

from pathlib import Path

from .binaries import binary
from .config import ClusterConfig
from .pki import Pki
from .runner_rules import runner_managed_jq

STAGES = Path(__file__).parent / "kwok"
KWOK_CRDS = STAGES / "crds"  # Logs, PortForward, Exec: the kubelet-API targets kwok watches
KWOK_KINDS = ("Logs", "PortForward", "Exec")
CONTROLLERS = tuple(f"{name}-controller" for name in (
    "serviceaccount", "serviceaccount-token", "namespace", "deployment", "replicaset", "statefulset", "daemonset",
    "job", "cronjob", "garbage-collector", "disruption", "pod-garbage-collector",
    "ttl-after-finished", "horizontal-pod-autoscaler", "resourcequota", "clusterrole-aggregation",
    "root-ca-certificate-publisher", "service-cidr", "taint-eviction",
    # claims (e2e/test_lora.py binds a hostPath PV): binding, and the finalizers that let them go
    "persistentvolume-binder", "persistentvolume-protection", "persistentvolumeclaim-protection"))


def etcd(cfg: ClusterConfig) -> list[str]:
    client, peer = (f"http://127.0.0.1:{cfg.ports[p]}" for p in ("etcd", "etcd-peer"))
    return [str(binary("etcd")), "--name=kubeinfer", f"--data-dir={cfg.state_dir / 'etcd'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kubeinfer={peer}", "--initial-cluster-state=new",
            "--unsafe-no-fsync=true", "--auto-compaction-retention=1", "--quota-backend-bytes=2147483648",
            "--log-level=warn"]


def kube_apiserver(cfg: ClusterConfig, pki: Pki) -> list[str]:
    return [str(binary("kube-apiserver")), "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={cfg.ports['kube-apiserver']}", "--endpoint-reconciler-type=none",
            f"--etcd-servers=http://127.0.0.1:{cfg.ports['etcd']}", "--etcd-prefix=/kubeinfer",
            f"--service-cluster-ip-range={cfg.service_cidr}", "--allow-privileged=true",
            "--authorization-mode=Node,RBAC", f"--token-auth-file={pki.token_file}", f"--client-ca-file={pki.ca}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--requestheader-client-ca-file={pki.ca}", "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--disable-admission-plugins=TaintNodesByCondition",  # its not-ready taint needs node lifecycle
            # kwok serves the nodes' kubelet API at 127.0.0.1 (nodes have no resolvable hostname)
            "--kubelet-preferred-address-types=InternalIP", f"--kubelet-certificate-authority={pki.ca}",
            "--enable-priority-and-fairness=false", "--profiling=false", "--v=1"]


def _component_auth(cfg: ClusterConfig, pki: Pki, name: str) -> list[str]:
    kubeconfig = pki.kubeconfig(name)
    return [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}", "--authorization-always-allow-paths=/healthz,/readyz,/livez",
            "--bind-address=127.0.0.1",
            f"--secure-port={cfg.ports[name]}", f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}", "--leader-elect=false", "--v=1"]


def kube_controller_manager(cfg: ClusterConfig, pki: Pki) -> list[str]:
    return [str(binary("kube-controller-manager")), *_component_auth(cfg, pki, "kube-controller-manager"),
            "--use-service-account-credentials=true", f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca}", f"--controllers={','.join(CONTROLLERS)}",
            f"--service-cluster-ip-range={cfg.service_cidr}", "--concurrent-deployment-syncs=10",
            "--kube-api-qps=200", "--kube-api-burst=400"]


def kube_scheduler(cfg: ClusterConfig, pki: Pki) -> list[str]:
    return [str(binary("kube-scheduler")), *_component_auth(cfg, pki, "kube-scheduler")]


def kwok_config(cfg: ClusterConfig) -> Path:
    """All pinned stages in one multi-document file, with the runner rule filled in."""
    rule = runner_managed_jq().replace("'", "''")  # the key sits in a single-quoted YAML string
    docs = [p.read_text().replace("__RUNNER_MANAGED__", rule) for p in sorted(STAGES.glob("*.yaml"))]
    path = cfg.state_dir / "kwok.yaml"
    path.write_text("\n---\n".join(docs))
    return path


def kwok(cfg: ClusterConfig, pki: Pki) -> list[str]:
    return [str(binary("kwok")), f"--kubeconfig={pki.kubeconfig('kwok')}", f"--config={kwok_config(cfg)}",
            "--manage-all-nodes=false", "--manage-nodes-with-label-selector=type=kwok",
            "--node-ip=127.0.0.1", f"--cidr={cfg.pod_cidr}", "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{cfg.ports['kwok']}", f"--node-port={cfg.ports['kwok']}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--enable-crds={','.join(KWOK_KINDS)}"]
