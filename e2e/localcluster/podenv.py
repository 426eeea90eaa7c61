"""A container's environment and command line as the kubelet would build them.

Covers what kubeinfer's pods use: literal values with ``$(VAR)`` expansion, ``fieldRef``
(pod name/namespace/uid/labels/annotations, node, service account, pod and host IPs),
``secretKeyRef``/``configMapKeyRef`` and ``envFrom``. Anything else is a ``ConfigError``, which
the runner reports as ``CreateContainerConfigError`` just like a kubelet would.
"""
from __future__ import annotations

import base64
import re

from kubernetes import client

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(ValueError):
    pass


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: unknown references stay as written, ``$$`` escapes."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def field_value(pod: dict, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    labelled = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if labelled:
        return (meta.get(labelled.group(1)) or {}).get(labelled.group(2), "")
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"),
              "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
              "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs") or []),
              "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs") or [])}
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef.fieldPath {path!r}")
    return simple[path] or ""


def _key_ref(core: client.CoreV1Api, namespace: str, kind: str, ref: dict) -> str | None:
    try:
        if kind == "secretKeyRef":
            data = core.read_namespaced_secret(ref["name"], namespace).data or {}
            value = data.get(ref["key"])
            value = base64.b64decode(value).decode() if value is not None else None
        else:
            value = (core.read_namespaced_config_map(ref["name"], namespace).data or {}).get(ref["key"])
    except client.ApiException as err:
        if err.status != 404:
            raise
        value = None
    if value is None and not ref.get("optional"):
        raise ConfigError(f"{kind} {ref['name']}/{ref['key']} not found in namespace {namespace}")
    return value


def _env_from(core: client.CoreV1Api, namespace: str, source: dict, secret: set[str]) -> dict[str, str]:
    kind = "secretRef" if "secretRef" in source else "configMapRef"
    ref = source[kind]
    try:
        if kind == "secretRef":
            data = {k: base64.b64decode(v).decode() for k, v in
                    (core.read_namespaced_secret(ref["name"], namespace).data or {}).items()}
        else:
            data = core.read_namespaced_config_map(ref["name"], namespace).data or {}
    except client.ApiException as err:
        if err.status != 404 or not ref.get("optional"):
            raise ConfigError(f"envFrom {kind} {ref['name']}: {err.reason}") from None
        data = {}
    found = {source.get("prefix", "") + k: v for k, v in data.items()}
    if kind == "secretRef":
        secret.update(found)
    return found


def container_env(core: client.CoreV1Api, pod: dict, container: dict,
                  secret: set[str] | None = None) -> dict[str, str]:
    """The variables the container would see (envFrom first, then env, in order); the names
    whose value came from a Secret are added to ``secret``."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    secret = set() if secret is None else secret
    for source in container.get("envFrom") or []:
        env.update(_env_from(core, namespace, source, secret))
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        secret.discard(var["name"])
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[var["name"]] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind = "secretKeyRef" if "secretKeyRef" in source else "configMapKeyRef"
            value = _key_ref(core, namespace, kind, source[kind])
            if value is not None:
                env[var["name"]] = value
                if kind == "secretKeyRef":
                    secret.add(var["name"])
        else:
            raise ConfigError(f"env {var['name']}: unsupported valueFrom {sorted(source)}")
    return env


def command_line(container: dict, env: dict[str, str], entrypoint: list[str]) -> list[str]:
    """command (or the image entrypoint, which for kubeinfer images is `kubeinfer`) + args."""
    argv = (container.get("command") or entrypoint) + (container.get("args") or [])
    return [expand(arg, env) for arg in argv]
