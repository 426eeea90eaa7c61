"""A local-path provisioner for the local cluster: claims of the ``local-path`` StorageClass get a
PersistentVolume on a directory under the cluster's state dir.

Why this shape: it is the external-provisioner protocol of a real cluster (Rancher's local-path
provisioner, a CSI driver's external-provisioner sidecar). The controller-manager's PV controller
marks a claim of this class with ``volume.kubernetes.io/storage-provisioner``; this creates a
PV with a ``claimRef`` to it, and the PV controller binds the two. A PV released by a deleted
claim is removed with its directory (``reclaimPolicy: Delete``). The directories are reachable
from every node (like network storage), so a ReadWriteMany claim works across nodes; the pod
runner mounts a claim at its PV's path (e2e/localcluster/podvolumes.py). Runs as a thread of the pod runner.
"""
from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from kubernetes import client

STORAGE_CLASS = "local-path"
PROVISIONER = "kubeinfer.io/local-path"
PROVISIONER_ANNOTATION = "volume.kubernetes.io/storage-provisioner"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"

log = logging.getLogger("provisioner")


def storage_class() -> dict:
    """The cluster's default StorageClass (claims that name none get it)."""
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS,
                         "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": PROVISIONER, "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate"}


def volume_for(pvc: client.V1PersistentVolumeClaim, root: Path) -> dict:
    name = f"pvc-{pvc.metadata.uid}"
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "annotations": {PROVISIONED_BY: PROVISIONER}},
            "spec": {"capacity": {"storage": pvc.spec.resources.requests["storage"]},
                     "accessModes": pvc.spec.access_modes, "storageClassName": pvc.spec.storage_class_name,
                     "persistentVolumeReclaimPolicy": "Delete",
                     "hostPath": {"path": str(root / name), "type": "DirectoryOrCreate"},
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                  "namespace": pvc.metadata.namespace, "name": pvc.metadata.name,
                                  "uid": pvc.metadata.uid}}}


def provision_once(core: client.CoreV1Api, root: Path) -> None:
    """Give every waiting claim of ours a volume; delete released volumes of ours."""
    volumes = core.list_persistent_volume().items
    claimed = {pv.spec.claim_ref.uid for pv in volumes if pv.spec.claim_ref}
    for pvc in core.list_persistent_volume_claim_for_all_namespaces().items:
        ours = (pvc.metadata.annotations or {}).get(PROVISIONER_ANNOTATION) == PROVISIONER
        if ours and pvc.status.phase == "Pending" and not pvc.spec.volume_name and pvc.metadata.uid not in claimed:
            body = volume_for(pvc, root)
            Path(body["spec"]["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
            core.create_persistent_volume(body)
            log.info("provisioned %s for %s/%s", body["metadata"]["name"], pvc.metadata.namespace,
                     pvc.metadata.name)
    for pv in volumes:
        ours = (pv.metadata.annotations or {}).get(PROVISIONED_BY) == PROVISIONER
        if ours and pv.status.phase == "Released" and pv.spec.persistent_volume_reclaim_policy == "Delete":
            shutil.rmtree(pv.spec.host_path.path, ignore_errors=True)
            core.delete_persistent_volume(pv.metadata.name)
            log.info("deleted %s", pv.metadata.name)


def run(core: client.CoreV1Api, root: Path, stopping: threading.Event, interval: float = 1.0) -> None:
    while not stopping.wait(interval):
        try:
            provision_once(core, root)
        except Exception:  # noqa: BLE001 - outlive apiserver hiccups, like the runner
            log.exception("provisioning failed")
