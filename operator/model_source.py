"""Where a pod finds its weights: `model.source` → volumes, init step and the engine's --model.

- `embedded`: the GGUF file inside the image; nothing to mount.
- `pvc://claim/path`: the claim mounted read-only at /models; path is a model dir or .gguf.
- `hf://org/name`: an init container (same image, the `hf` CLI of huggingface_hub) downloads
  the repository into an emptyDir before the engine starts.

LoRA adapters (`spec.adapters`, `pvc://claim/path` only) are loaded into running pods, so their
files must already be there: each pod mounts, read-only, every claim its adapters name (the
model's claim is reused at /models, others go under /adapters/<claim>). The volumes depend on
the set of claims only, never on the adapter list, so adding an adapter on a mounted claim
leaves the pod template alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from . import api
from .security import restricted_container
from .resource import InferenceService
from .spec import AdapterSpec

EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded GGUF's own name, the engine's default id


@dataclass(frozen=True)
class ModelMounts:
    model_path: str
    served_name: str | None = None
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_mounts(isvc: InferenceService, image: str) -> ModelMounts:
    source = isvc.spec.model.source
    if source == "embedded":
        return ModelMounts(model_path="embedded", served_name=EMBEDDED_SERVED_NAME)
    scheme, _, rest = source.partition("://")
    claim_or_org, _, path = rest.partition("/")
    if scheme == "pvc":
        return ModelMounts(
            model_path=f"{api.MODEL_MOUNT}/{path}".rstrip("/"),
            volumes=[{"name": "model", "persistentVolumeClaim": {"claimName": claim_or_org,
                                                                 "readOnly": True}}],
            volume_mounts=[{"name": "model", "mountPath": api.MODEL_MOUNT, "readOnly": True}])
    if scheme == "hf":
        repo = rest
        local_dir = f"{api.MODEL_MOUNT}/{repo}"
        env = [{"name": "HOME", "value": "/tmp"},
               {"name": "HF_HOME", "value": f"{api.MODEL_MOUNT}/.cache"}]
        ref = isvc.spec.model.token_secret_ref
        if ref:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": ref.name, "key": ref.key}}})
        download = {"name": "download-model", "image": image,
                    "command": ["hf", "download", repo, "--local-dir", local_dir],
                    "env": env, "securityContext": restricted_container(),
                    "volumeMounts": [{"name": "model", "mountPath": api.MODEL_MOUNT},
                                     {"name": "tmp", "mountPath": "/tmp"}]}
        return ModelMounts(
            model_path=local_dir, served_name=repo,
            volumes=[{"name": "model", "emptyDir": {}}],
            volume_mounts=[{"name": "model", "mountPath": api.MODEL_MOUNT, "readOnly": True}],
            init_containers=[download])
    raise ValueError(f"unknown model source scheme in {source!r}")


def _pvc(source: str) -> tuple[str, str]:
    """(claim, path inside it) of a `pvc://claim/path` source."""
    claim, _, path = source.removeprefix("pvc://").partition("/")
    return claim, path


def model_claim(isvc: InferenceService) -> str | None:
    source = isvc.spec.model.source
    return _pvc(source)[0] if source.startswith("pvc://") else None


def adapter_mount(claim: str) -> str:
    return f"{api.ADAPTER_MOUNT}/{claim}"


def adapter_path(isvc: InferenceService, adapter: AdapterSpec) -> str:
    """Where the engine finds `adapter`'s files inside the pod (the `lora_path` it is loaded from)."""
    return _pvc_path(isvc, adapter.source)


def draft_model_path(isvc: InferenceService) -> str | None:
    """Where the engine finds the speculative draft model (`engine.speculative.draftModel`), if any."""
    speculative = isvc.spec.engine.speculative
    if speculative is None or speculative.draft_model is None:
        return None
    return _pvc_path(isvc, speculative.draft_model)


def _pvc_path(isvc: InferenceService, source: str) -> str:
    claim, path = _pvc(source)
    root = api.MODEL_MOUNT if claim == model_claim(isvc) else adapter_mount(claim)
    return f"{root}/{path}".rstrip("/")


def adapter_volumes(isvc: InferenceService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the adapters' claims (and the draft model's) other than the
    model's, in claim order."""
    claims = {_pvc(a.source)[0] for a in isvc.spec.adapters}
    speculative = isvc.spec.engine.speculative
    if speculative is not None and speculative.draft_model is not None:   # mounted like adapters' claims
        claims.add(_pvc(speculative.draft_model)[0])
    claims = sorted(claims - {model_claim(isvc)})
    volumes, mounts = [], []
    for claim in claims:  # volume names are DNS labels; claim names may be longer
        name = "adapters-" + hashlib.sha256(claim.encode()).hexdigest()[:12]
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": adapter_mount(claim), "readOnly": True})
    return volumes, mounts
