"""Where a pod finds its weights: `model.source` → volumes, init step and the engine's --model.

- `embedded`: the GGUF file inside the image; nothing to mount.
- `pvc://claim/path`: the claim mounted read-only at /models; path is a model dir or .gguf.
- `hf://org/name`: an init container (same image, the `hf` CLI of huggingface_hub) downloads
  the repository into an emptyDir before the engine starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import api
from .security import restricted_container
from .resource import InferenceService

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
