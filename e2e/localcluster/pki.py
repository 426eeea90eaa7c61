"""Certificates, tokens and kubeconfigs for the local control plane, made with openssl at start-up.

Why openssl: it is on every machine, and a fresh CA per cluster means nothing secret lives in
the repo. Clients authenticate with static bearer tokens (one per component) so RBAC sees real
identities: ``admin`` is in ``system:masters``; the scheduler and controller-manager get their
built-in users, whose bootstrap ClusterRoleBindings already exist.
"""
from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

USERS = {  # kubeconfig name -> (user, groups)
    "admin": ("kubeinfer-admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", ""),
    "kube-scheduler": ("system:kube-scheduler", ""),
    "kwok": ("kwok-controller", "system:masters"),
}


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def serving_cert(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    @property
    def token_file(self) -> Path:
        return self.dir / "tokens.csv"

    def kubeconfig(self, name: str) -> Path:
        return self.dir / f"{name}.kubeconfig"

    def token(self, name: str) -> str:
        """The bearer token of a USERS entry, read back from the apiserver's token file."""
        user = USERS[name][0]
        return next(row.split(",")[0] for row in self.token_file.read_text().splitlines() if row.split(",")[1] == user)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def create(pki_dir: Path, server: str, service_ip: str) -> Pki:
    """CA, apiserver serving cert (SANs: loopback, the service names and the service IP),
    service-account signing key pair, one token per user and one kubeconfig per user."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    pki = Pki(pki_dir)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-keyout", "ca.key", "-out", "ca.crt",
             "-subj", "/CN=kubeinfer-local-ca", cwd=pki_dir)
    sans = ",".join(["IP:127.0.0.1", f"IP:{service_ip}", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
                     "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"])
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=pki_dir)
    (pki_dir / "apiserver.ext").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "3650", "-extfile", "apiserver.ext", "-out", "apiserver.crt", cwd=pki_dir)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki_dir)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki_dir)
    tokens = {name: secrets.token_hex(24) for name in USERS}
    rows = [f'{tokens[name]},{user},{user},"{groups}"' if groups else f"{tokens[name]},{user},{user}"
            for name, (user, groups) in USERS.items()]
    pki.token_file.write_text("\n".join(rows) + "\n")
    for name in USERS:
        pki.kubeconfig(name).write_text(kubeconfig(server, pki.ca, tokens[name], name))
        pki.kubeconfig(name).chmod(0o600)
    return pki


def kubeconfig(server: str, ca: Path, token: str, user: str) -> str:
    return f"""apiVersion: v1
kind: Config
clusters:
- name: kubeinfer-local
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {user}
  user:
    token: {token}
contexts:
- name: kubeinfer-local
  context:
    cluster: kubeinfer-local
    user: {user}
current-context: kubeinfer-local
"""
