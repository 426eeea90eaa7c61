"""Where a pod finds its weights: `model.source` → volumes, init step and the engine's --model.

- `embedded`: the GGUF file inside the image; nothing to mount.
- `pvc://claim/path`: the claim mounted read-only at /models; path is a model dir or .gguf.
- `hf://org/name[@rev]`, `s3://bucket/prefix`: the node's model cache (docs/model-sources.md).
  An init container (`kubeinfer fetch`, same image) brings the weights into a cache on the
  node (a hostPath, or a claim the chart names) keyed by source and resolved revision, under
  the cache's lock: the first pod on a node downloads, later ones find the files. The engine
  mounts the cache read-only and serves the same pinned source from it. hf:// revisions are
  resolved to a commit by the operator once per generation (`pinned_source`).

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
from .resource import InferenceService, OperatorConfig
from .spec import AdapterSpec

EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded GGUF's own name, the engine's default id
CACHE_VOLUME = "model-cache"


@dataclass(frozen=True)
class ModelMounts:
    model_path: str
    served_name: str | None = None
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)  # the engine's, for the source
    env_from: list[dict[str, Any]] = field(default_factory=list)


def pinned_source(isvc: InferenceService) -> str:
    """The source every pod of this generation serves: an hf:// revision as the operator
    resolved it to a commit (status.model.revision), so a moved branch head changes nothing."""
    source = isvc.spec.model.source
    if source.startswith("hf://") and isvc.resolved_revision:
        return f"{source.partition('@')[0]}@{isvc.resolved_revision}"
    return source


def served_name(isvc: InferenceService) -> str:
    """The repo id (as vLLM names an hf model), or an s3:// prefix's last segment."""
    rest = isvc.spec.model.source.partition("://")[2].partition("@")[0]
    if isvc.spec.model.source.startswith("hf://"):
        return rest
    bucket, _, prefix = rest.partition("/")
    return prefix.rstrip("/").rsplit("/", 1)[-1] or bucket


def cache_key(isvc: InferenceService) -> str:
    """The node label that says a node holds these weights: models.kubeinfer.io/<digest>."""
    return source_label(pinned_source(isvc))


def source_label(pinned: str) -> str:
    """models.kubeinfer.io/<digest of a pinned source>, as a fetch names what it fetched or evicted."""
    return f"{api.MODEL_LABEL_PREFIX}/{hashlib.sha256(pinned.encode()).hexdigest()[:16]}"


def source_env(isvc: InferenceService, config: OperatorConfig, serving: bool) -> list[dict[str, Any]]:
    """Where the weights come from and the credentials to get them. The engine gets the same
    (it finds the fetched snapshot in the cache, an s3:// one by listing the bucket again) and,
    for hf://, HF_HUB_OFFLINE: it never downloads, the fetch did."""
    model = isvc.spec.model
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "KUBEINFER_CACHE", "value": api.MODEL_CACHE_MOUNT}]
    if model.source.startswith("hf://"):
        endpoint = model.endpoint or config.hf_endpoint
        if endpoint:
            env.append({"name": "HF_ENDPOINT", "value": endpoint})
        if model.token_secret_ref:
            ref = model.token_secret_ref
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
        if serving:
            env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    elif model.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": model.endpoint})
    return env


def fetch_container(isvc: InferenceService, image: str, config: OperatorConfig) -> dict[str, Any]:
    """`kubeinfer fetch` into the node's cache: the first pod (or warm-ahead Job) on a node
    downloads under the cache's lock, the others find the snapshot there. A failure exits with
    a code the operator names (exit_codes) and its message as the termination message."""
    args = ["fetch", "--model", pinned_source(isvc), "--cache-dir", f"{api.MODEL_CACHE_MOUNT}/models"]
    if config.model_cache_budget:
        args += ["--cache-budget", config.model_cache_budget]
    container = {"name": api.FETCH_CONTAINER, "image": image, "command": ["kubeinfer"], "args": args,
                 "env": source_env(isvc, config, serving=False), "securityContext": restricted_container(),
                 "terminationMessagePolicy": "FallbackToLogsOnError",
                 "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": api.MODEL_CACHE_MOUNT},
                                  {"name": "tmp", "mountPath": "/tmp"}]}
    if isvc.spec.model.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": isvc.spec.model.credentials_secret}}]
    return container


def model_mounts(isvc: InferenceService, image: str, config: OperatorConfig) -> ModelMounts:
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
    if scheme in ("hf", "s3"):
        volume = ({"persistentVolumeClaim": {"claimName": config.model_cache_claim}} if config.model_cache_claim
                  else {"hostPath": {"path": config.model_cache_path, "type": "DirectoryOrCreate"}})
        return ModelMounts(
            model_path=pinned_source(isvc), served_name=served_name(isvc),
            volumes=[{"name": CACHE_VOLUME, **volume}],
            volume_mounts=[{"name": CACHE_VOLUME, "mountPath": api.MODEL_CACHE_MOUNT, "readOnly": True}],
            init_containers=[fetch_container(isvc, image, config)], env=source_env(isvc, config, serving=True),
            env_from=fetch_container(isvc, image, config).get("envFrom", []))
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
