"""Pod Security Standards "restricted" contexts for every container the operator creates."""

from __future__ import annotations

from typing import Any

# A fixed non-root uid works whatever USER the image declares; fsGroup makes PVCs readable.
NON_ROOT_UID = 65532


def restricted_pod() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
            "fsGroup": NON_ROOT_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def restricted_container() -> dict[str, Any]:
    """Read-only root: the engine writes only to the /tmp emptyDir (HOME and caches)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
