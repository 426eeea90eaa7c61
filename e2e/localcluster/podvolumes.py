"""A runner pod's volumes as host directories, and its containers' mount paths mapped onto them.

Pods here are host processes without mount namespaces, so a volume cannot appear at its
``mountPath``. Instead each volume gets a host directory, and every occurrence of a container's
mount path in its command line and environment (after ``$(VAR)`` expansion) is rewritten to that
directory: ``--model /models/x`` becomes ``--model <pod dir>/volumes/model/x``. Each pod also gets
``<pod dir>/root``, a tree of symlinks from each mount path to its directory, for a look at
what the pod would see. Paths a process learns at run time (a file it reads, an API call) are
not rewritten; read-only mounts are not enforced.

Where the directories are, as on a real node:
- ``emptyDir``: ``<pod dir>/volumes/<volume>``, gone with the pod;
- ``hostPath``: ``<nodes dir>/<node>/<path>``: one tree per node, shared by that node's pods;
- ``configMap`` / ``secret``: ``<pod dir>/volumes/<volume>``, holding one file per key (or ``items``);
  ``downwardAPI`` likewise with one file per item (the pod's fields as ``env`` reads them), and
  ``projected`` with the files of all its sources (configMap, secret, downwardAPI; one with a
  ``serviceAccountToken`` source is left empty); kept up to date with their sources while the
  pod runs (``sync_volume_files``);
- ``persistentVolumeClaim``: the bound PersistentVolume's ``hostPath``/``local`` path, taken
  as a host path (the local provisioner, e2e/localcluster/provisioner.py, puts them under the cluster's
  state dir, reachable from every node like network storage). An unbound claim keeps the pod
  in ContainerCreating, as a kubelet would.
Other volume types get a directory of their own, empty, so the pod still starts.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path

from kubernetes import client

from .podenv import ConfigError, field_value


class VolumeNotReady(RuntimeError):
    """A volume cannot be set up yet (an unbound claim); the runner retries."""


def _key_files(directory: Path, data: dict[str, bytes], items: list[dict] | None, mode: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    wanted = [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else \
        [(key, key, mode) for key in data]
    for key, rel, file_mode in wanted:
        if key not in data:
            raise ConfigError(f"key {key!r} not found")
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[key])
        path.chmod(file_mode)


def _claim_path(core: client.CoreV1Api, namespace: str, claim: str) -> Path:
    try:
        pvc = core.read_namespaced_persistent_volume_claim(claim, namespace)
    except client.ApiException as err:
        if err.status == 404:
            raise VolumeNotReady(f'persistentvolumeclaim "{claim}" not found') from None
        raise
    if pvc.status.phase != "Bound" or not pvc.spec.volume_name:
        raise VolumeNotReady(f'persistentvolumeclaim "{claim}" is not bound')
    pv = core.read_persistent_volume(pvc.spec.volume_name)
    source = pv.spec.host_path or pv.spec.local
    if source is None:
        raise ConfigError(f"persistentvolume {pv.metadata.name}: only hostPath and local volumes mount here")
    return Path(source.path)


def _projected_files(volume: dict) -> bool:
    """A projected volume of files; not the API-access volume the ServiceAccount admission adds
    (a ``serviceAccountToken`` source): local processes get their credentials otherwise
    (localpod.py), so that one stays an empty directory."""
    sources = (volume.get("projected") or {}).get("sources")
    return bool(sources) and all({"configMap", "secret", "downwardAPI"} & source.keys() for source in sources)


def _source_files(core: client.CoreV1Api, pod: dict, directory: Path, source: dict, mode: int,
                  volume: str) -> None:
    """One ``configMap``, ``secret`` or ``downwardAPI`` source (a volume of its own, or one of a
    ``projected`` volume's sources) written as files into ``directory``."""
    if "downwardAPI" in source:
        for item in source["downwardAPI"].get("items") or []:
            path = directory / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(field_value(pod, item["fieldRef"]["fieldPath"]))
            path.chmod(item.get("mode", source["downwardAPI"].get("defaultMode", mode)))
        return
    kind = "configMap" if "configMap" in source else "secret"
    ref_source = source[kind]
    ref = ref_source.get("name") or ref_source.get("secretName")
    namespace = pod["metadata"]["namespace"]
    try:
        if kind == "secret":
            data = {k: base64.b64decode(v) for k, v in
                    (core.read_namespaced_secret(ref, namespace).data or {}).items()}
        else:
            cm = core.read_namespaced_config_map(ref, namespace)
            data = {k: v.encode() for k, v in (cm.data or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()})
    except client.ApiException as err:
        if err.status != 404 or not ref_source.get("optional"):
            raise VolumeNotReady(f'{kind} "{ref}" not found') from None
        data = {}
    try:
        _key_files(directory, data, ref_source.get("items"), ref_source.get("defaultMode", mode))
    except ConfigError as err:
        raise ConfigError(f"volume {volume}: {kind} {ref}: {err}") from None


def volume_dirs(core: client.CoreV1Api, pod: dict, pod_dir: Path, nodes_dir: Path) -> dict[str, Path]:
    """Create (or find) each volume's host directory; volume name -> directory."""
    namespace, node = pod["metadata"]["namespace"], pod["spec"].get("nodeName", "")
    dirs: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name, own = volume["name"], pod_dir / "volumes" / volume["name"]
        if "hostPath" in volume:
            path = nodes_dir / node / volume["hostPath"]["path"].lstrip("/")
            if volume["hostPath"].get("type", "") in ("", "DirectoryOrCreate", "Directory"):
                path.mkdir(parents=True, exist_ok=True)
            dirs[name] = path
        elif "persistentVolumeClaim" in volume:
            dirs[name] = _claim_path(core, namespace, volume["persistentVolumeClaim"]["claimName"])
        elif _holds_files(volume):
            shutil.rmtree(own, ignore_errors=True)
            _volume_files(core, pod, own, volume)
            dirs[name] = own
        else:  # emptyDir and anything else: a directory of the pod's own
            own.mkdir(parents=True, exist_ok=True)
            dirs[name] = own
    return dirs


def _holds_files(volume: dict) -> bool:
    return "configMap" in volume or "secret" in volume or "downwardAPI" in volume or _projected_files(volume)


def _volume_files(core: client.CoreV1Api, pod: dict, directory: Path, volume: dict) -> None:
    """A configMap, secret, downwardAPI or projected volume's files, written into `directory`."""
    projected = volume.get("projected") or {}
    mode = projected.get("defaultMode", 0o644)
    for source in projected.get("sources") or [volume]:
        _source_files(core, pod, directory, source, mode, volume["name"])
    directory.mkdir(parents=True, exist_ok=True)


def sync_volume_files(core: client.CoreV1Api, pod: dict, pod_dir: Path) -> None:
    """Bring the pod's configMap, secret and projected volumes up to date with their sources,
    as the kubelet's sync does while a pod runs (so a rotated Secret reaches it without a
    restart): each changed file is replaced in one step (a rename), a file gone from the source
    is removed; a source that cannot be read now leaves its files as they are."""
    for volume in pod["spec"].get("volumes") or []:
        if not _holds_files(volume):
            continue
        own = pod_dir / "volumes" / volume["name"]
        staging = pod_dir / "volumes" / f".{volume['name']}.sync"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _volume_files(core, pod, staging, volume)
        except (VolumeNotReady, ConfigError):
            shutil.rmtree(staging, ignore_errors=True)
            continue
        fresh = {path.relative_to(staging) for path in staging.rglob("*") if path.is_file()}
        for rel in fresh:
            target = own / rel
            if not target.is_file() or target.read_bytes() != (staging / rel).read_bytes():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / rel, target)
        for path in own.rglob("*"):
            if path.is_file() and path.relative_to(own) not in fresh:
                path.unlink()
        shutil.rmtree(staging, ignore_errors=True)


def container_mounts(container: dict, dirs: dict[str, Path]) -> dict[str, Path]:
    """mountPath -> host directory for one container (subPath included)."""
    mounts = {}
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in dirs:
            raise ConfigError(f"volumeMount {mount['mountPath']}: no volume named {mount['name']!r}")
        host = dirs[mount["name"]] / mount.get("subPath", "")
        if mount.get("subPath"):
            host.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"].rstrip("/") or "/"] = host
    return mounts


def link_root(root: Path, mounts: dict[str, Path]) -> None:
    """``root/<mountPath>`` -> host directory, for each mount."""
    for mount_path, host in mounts.items():
        link = root / mount_path.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(host, target_is_directory=True)


def path_rewriter(mounts: dict[str, Path]):
    """A function that maps the container's view of paths in a string to the host's.

    A mount path matches only as a whole path: at the start of the string or after a space,
    quote, ``=``, ``:`` or ``,``, and followed by ``/``, the end or such a separator; the
    longest mount path wins (``/models/cache`` before ``/models``)."""
    if not mounts:
        return lambda text: text
    paths = sorted(mounts, key=len, reverse=True)
    pattern = re.compile(r"(?:^|(?<=[\s'\"=:,]))(" + "|".join(re.escape(p) for p in paths) +
                         r")(?=$|[/\s'\";:,])")
    return lambda text: pattern.sub(lambda m: str(mounts[m.group(1)]), text)
