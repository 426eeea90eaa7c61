"""InferenceService → engine Deployment (single-pod replicas) or LeaderWorkerSet (replicas that
span pods), as a plain dict ready for server-side apply.

Pure: the same input always yields the same object, so re-applying it is a no-op and any
drift (an edited arg, a deleted Deployment) is undone by applying it again.
"""

from __future__ import annotations

import json
from typing import Any

from kubeinfer.server.engine.spec_decode.config import SpeculativeConfig
from kubeinfer.server.flags import ENGINE_FLAGS, LONG_CONTEXT_TOKENS, default_max_body_bytes, to_args
from . import api, hash_key
from .model_source import adapter_volumes, cache_key, draft_model_path, model_mounts
from .resource import InferenceService, OperatorConfig
from .security import restricted_container, restricted_pod
from .spec import flag

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
PRE_STOP_SECONDS = 5  # lets Service endpoints drop the pod before the server stops accepting
GRACE_MARGIN_SECONDS = 10
PROGRESS_DEADLINE_SECONDS = 900


def device(isvc: InferenceService) -> str:
    """The engine's device; `auto` asks for GPUs only when a GPU product is named, so a spec
    that names no GPU runs (and becomes Ready) on a cluster without any."""
    if isvc.spec.engine.device != "auto":
        return isvc.spec.engine.device
    return "cuda" if isvc.spec.resources.gpu_product else "cpu"


def engine_args(isvc: InferenceService, model_path: str, served_name: str | None) -> list[str]:
    """`kubeinfer serve` arguments, rendered by the shared flag table (defaults are omitted)."""
    model, engine = isvc.spec.model, isvc.spec.engine
    values = {"model": model_path, "served_model_name": model.served_name or served_name,
              "dtype": model.dtype, "device": device(isvc), "block_size": engine.block_size,
              "quantization": engine.quantization, "kv_cache_dtype": engine.kv_cache_dtype,
              "kv_cache_memory": engine.kv_cache_memory,
              "gpu_memory_utilization": engine.kv_cache_memory_fraction,
              "max_num_seqs": engine.max_num_seqs,
              "max_num_batched_tokens": engine.max_num_batched_tokens,
              "max_model_len": model.max_model_len, "task": model.task,
              "enable_prefix_caching": engine.prefix_cache.enabled,
              "tensor_parallel_size": engine.tensor_parallel_size,
              "pipeline_parallel_size": engine.pipeline_parallel_size, **lora_values(isvc),
              "speculative_config": speculative_config(isvc)}
    return ["serve", *to_args(values, ENGINE_FLAGS), *engine.extra_args]


def group_args(isvc: InferenceService, worker: bool) -> list[str]:
    """vLLM's multi-node flags from LWS's environment (the kubelet expands `$(VAR)` in args):
    the group's size, this pod's index in it (0: the leader) and the leader's address."""
    values = {"nnodes": isvc.spec.engine.pods_per_replica, "node_rank": "$(LWS_WORKER_INDEX)",
              "master_addr": "$(LWS_LEADER_ADDRESS)", "master_port": api.MASTER_PORT}
    args = [arg for name, value in values.items() for arg in (flag(name).option, str(value))]
    return [*args, flag("headless").option] if worker else args


def gpus_per_pod(isvc: InferenceService) -> int:
    engine = isvc.spec.engine
    return engine.tensor_parallel_size * engine.pipeline_parallel_size // engine.pods_per_replica


def speculative_config(isvc: InferenceService) -> SpeculativeConfig | None:
    """`spec.engine.speculative` as the engine's --speculative-config (validated the same way)."""
    spec = isvc.spec.engine.speculative
    if spec is None:
        return None
    values: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                              "prompt_lookup_min": spec.prompt_lookup_min,
                              "prompt_lookup_max": spec.prompt_lookup_max, "model": draft_model_path(isvc)}
    if spec.disable_by_batch_size is not None:
        values["disable_by_batch_size"] = spec.disable_by_batch_size
    return SpeculativeConfig(**values)


def lora_values(isvc: InferenceService) -> dict[str, Any]:
    """LoRA support and its limits, but no `--lora-modules`: the adapter list must not be part
    of the pod template (editing it would restart every pod), so the operator loads adapters
    through the engines' runtime API (served with KUBEINFER_ALLOW_RUNTIME_LORA_UPDATING, see
    `engine_env`, on the admin port only), into a new pod before its readiness gate opens."""
    lora = isvc.spec.engine.lora
    if not isvc.spec.lora_enabled:
        return {}
    return {"enable_lora": True, "max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank,
            "max_cpu_loras": lora.max_cpu_loras}


def auth_env(isvc: InferenceService) -> list[tuple[str, dict[str, Any]]]:
    """`spec.auth` for every process that checks keys (engines, the gateway): the keys come from
    the Secret as an env var, so they appear neither in `ps` nor in the pod spec, and the
    process refuses to start if the Secret's value holds no key instead of serving openly."""
    ref = isvc.spec.auth.api_key_secret_ref
    if ref is None:
        return []
    return [(flag("api_keys").env, {"valueFrom": {"secretKeyRef": {"name": ref.name,
                                                                   "key": ref.key}}}),
            (flag("require_api_key").env, {"value": "true"})]


TENANTS_DIR = "/etc/kubeinfer/tenants"
TENANTS_TABLE = "tenants.json"   # the inline table, without keys, in TENANTS_DIR
TENANT_KEYS_DIR = "keys"         # each tenant's keys Secret, at keys/<secret>/<key> in TENANTS_DIR


def tenants_file(isvc: InferenceService) -> str | None:
    """The pods' --tenants-file: the Secret's file, or the inline table; None without either."""
    tenancy = isvc.spec.tenancy
    if tenancy.tenants_secret_ref is not None:
        return f"{TENANTS_DIR}/{tenancy.tenants_secret_ref.key}"
    return f"{TENANTS_DIR}/{TENANTS_TABLE}" if tenancy.inline else None


def tenant_table(isvc: InferenceService) -> dict[str, Any]:
    """`spec.tenancy`'s inline table as a tenant file (server/tenancy.py) with no key in it: each
    tenant's `keys_file` is its Secret's key as mounted beside the file (a relative path, read
    from the file's directory)."""
    tenancy = isvc.spec.tenancy
    tenants = []
    for tenant in tenancy.tenants:
        entry: dict[str, Any] = {"name": tenant.name, "priority": tenant.priority}
        quotas = {"tokens_per_minute": tenant.quotas.tokens_per_minute,
                  "requests_per_minute": tenant.quotas.requests_per_minute}
        if any(quotas.values()):
            entry["quotas"] = {name: value for name, value in quotas.items() if value}
        ref = tenant.api_keys_secret_ref
        if ref is not None:
            entry["keys_file"] = f"{TENANT_KEYS_DIR}/{ref.name}/{ref.key}"
        tenants.append(entry)
    return {"priority_range": list(tenancy.bounds), "objectives": dict(sorted(tenancy.objectives.items())),
            "tenants": tenants}


def tenancy_annotations(isvc: InferenceService) -> dict[str, str]:
    """The inline table on the pod template, which the pods read through the downward API: the
    operator needs no ConfigMap (nor RBAC for one), and editing the table rolls the pods, which
    read it when they start."""
    if not isvc.spec.tenancy.inline:
        return {}
    return {api.TENANTS_ANNOTATION: json.dumps(tenant_table(isvc), separators=(",", ":"))}


def tenancy_env(isvc: InferenceService) -> list[tuple[str, dict[str, Any]]]:
    """`spec.tenancy` for engines and routers: the tenant file's path in the mounted volume."""
    path, env = tenants_file(isvc), []
    if path is not None:
        env.append((flag("tenants_file").env, {"value": path}))
    if isvc.spec.tenancy.trust_tenant_header:
        env.append((flag("trust_tenant_header").env, {"value": "true"}))
    return env


def tenancy_volumes(isvc: InferenceService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the tenant file, read-only: the Secret holding it, or one projected
    volume with the inline table (from the pod's annotation) and the tenants' key Secrets under
    keys/<secret>/<key>; none without tenancy. The kubelet reads the Secrets, not the operator."""
    tenancy = isvc.spec.tenancy
    mounts = [{"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}]
    ref = tenancy.tenants_secret_ref
    if ref is not None:
        return [{"name": "tenants", "secret": {"secretName": ref.name,
                                               "items": [{"key": ref.key, "path": ref.key}]}}], mounts
    if not tenancy.inline:
        return [], []
    table = {"fieldRef": {"fieldPath": f"metadata.annotations['{api.TENANTS_ANNOTATION}']"}, "path": TENANTS_TABLE}
    keys: dict[str, list[str]] = {}   # secret -> its keys, in the table's order
    for ref in (t.api_keys_secret_ref for t in tenancy.tenants if t.api_keys_secret_ref is not None):
        if ref.key not in keys.setdefault(ref.name, []):
            keys[ref.name].append(ref.key)
    sources = [{"downwardAPI": {"items": [table]}},
               *({"secret": {"name": secret, "items": [{"key": key, "path": f"{TENANT_KEYS_DIR}/{secret}/{key}"}
                                                       for key in secret_keys]}}
                 for secret, secret_keys in keys.items())]
    return [{"name": "tenants", "projected": {"sources": sources}}], mounts


def shared_env(isvc: InferenceService) -> list[tuple[str, dict[str, Any]]]:
    """What engines and routers must agree on: the API keys, the request body limit (the router
    answers 413 as the engine would, before holding a body), the block-hash secret."""
    limit = default_max_body_bytes(isvc.spec.model.max_model_len or LONG_CONTEXT_TOKENS)
    return [*auth_env(isvc), (flag("max_request_body_bytes").env, {"value": str(limit)}), hash_key.env(isvc)]


def engine_env(isvc: InferenceService, config: OperatorConfig | None = None,
               source_env: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Server flags as env vars (named by the flag table); the user's `engine.env` wins.

    The server binds every address of its pod (as vLLM and KServe do), so Services, probes
    and `kubectl port-forward` (which dials the pod's localhost) all reach it. What only the
    operator and routers call is on the admin port, which the Service does not expose; the
    block hashes routers read are keyed with the service's Secret (`hash_key`).
    """
    ours: list[tuple[str, dict[str, Any]]] = [
        ("HOME", {"value": "/tmp"}), (flag("host").env, {"value": "0.0.0.0"}),
        (flag("port").env, {"value": str(api.HTTP_PORT)}),
        (flag("shutdown_timeout").env, {"value": str(isvc.spec.rollout.drain_seconds)}),
        (flag("admin_port").env, {"value": str(api.ADMIN_PORT)}), *shared_env(isvc), *tenancy_env(isvc),
        *((env["name"], {k: v for k, v in env.items() if k != "name"}) for env in source_env)]
    tracing = isvc.spec.tracing
    endpoint = tracing.otlp_endpoint or (config.otlp_traces_endpoint if config is not None else None)
    if endpoint:
        ours += [(flag("otlp_traces_endpoint").env, {"value": endpoint}),
                 (flag("otlp_traces_sampling_ratio").env, {"value": str(tracing.sampling_ratio)})]
    if isvc.spec.lora_enabled:
        ours.append((flag("allow_runtime_lora_updating").env, {"value": "true"}))
    merged = {name: {"name": name, **source} for name, source in ours}
    merged.update({env["name"]: env for env in isvc.spec.engine.env})
    return list(merged.values())


def engine_resources(isvc: InferenceService) -> dict[str, Any]:
    res = isvc.spec.resources
    limits: dict[str, Any] = {"memory": str(res.memory)}
    if device(isvc) == "cuda":
        limits[GPU_RESOURCE] = gpus_per_pod(isvc)
    return {"requests": {"cpu": str(res.cpu), "memory": str(res.memory)}, "limits": limits}


def probes() -> dict[str, Any]:
    """Startup waits out model loading; readiness gates traffic; liveness catches a hung loop."""
    def get(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
                "timeoutSeconds": 5, "failureThreshold": failures}
    # The server answers only once the model is loaded, so a new replica's wait for traffic is its
    # load plus the startup probe's period plus the readiness probe's: polled every 1 s and 2 s
    # (a loopback GET each; 30 min and 16 s to give up, as with 5 s periods), not 5 s and 5 s.
    return {"startupProbe": get("/health", 1, 1800), "readinessProbe": get("/ready", 2, 8),
            "livenessProbe": get("/health", 10, 6)}


def cache_affinity(isvc: InferenceService, affinity: dict[str, Any] | None) -> dict[str, Any] | None:
    """The user's affinity plus, for fetched weights, a preference for nodes whose cache holds
    them (the label the operator sets, operator/model_cache.py): a warm node starts in seconds."""
    if not isvc.spec.model.source.startswith(("hf://", "s3://")):
        return affinity
    term = {"weight": 100, "preference": {"matchExpressions": [{"key": cache_key(isvc), "operator": "Exists"}]}}
    affinity = affinity or {}
    node = dict(affinity.get("nodeAffinity") or {})
    node["preferredDuringSchedulingIgnoredDuringExecution"] = [
        *node.get("preferredDuringSchedulingIgnoredDuringExecution", []), term]
    return {**affinity, "nodeAffinity": node}


def pod_spec(isvc: InferenceService, config: OperatorConfig, role: str = "single") -> dict[str, Any]:
    """The engine pod; `role` "leader" / "worker" for the pods of a multi-pod group (a worker
    runs its ranks headless: no API, so no port and no HTTP probes)."""
    spec = isvc.spec
    mounts = model_mounts(isvc, spec.engine.image or config.engine_image, config)
    adapter_vols, adapter_mounts = adapter_volumes(isvc)
    tenant_vols, tenant_mounts = tenancy_volumes(isvc)
    volumes = [{"name": "tmp", "emptyDir": {}}, *mounts.volumes, *adapter_vols, *tenant_vols]
    volume_mounts = [{"name": "tmp", "mountPath": "/tmp"}, *mounts.volume_mounts, *adapter_mounts, *tenant_mounts]
    if gpus_per_pod(isvc) > 1:  # NCCL/ranks exchange tensors through /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        volume_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container = {
        "name": api.ENGINE_CONTAINER, "image": spec.engine.image or config.engine_image,
        "command": ["kubeinfer"], "args": engine_args(isvc, mounts.model_path, mounts.served_name)
        + (group_args(isvc, role == "worker") if role != "single" else []),
        "env": engine_env(isvc, config, mounts.env), **({"envFrom": mounts.env_from} if mounts.env_from else {}),
        "ports": [{"name": "http", "containerPort": api.HTTP_PORT, "protocol": "TCP"},
                  {"name": "admin", "containerPort": api.ADMIN_PORT, "protocol": "TCP"}],
        "resources": engine_resources(isvc), **probes(),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "securityContext": restricted_container(), "volumeMounts": volume_mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",  # crash reasons reach status
    }
    if role == "worker":   # its ranks exit (and LWS recreates the group) when they cannot serve
        for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
            del container[key]
    node_selector = dict(spec.node_selector)
    tolerations = list(spec.tolerations)
    if spec.resources.gpu_product:
        node_selector[GPU_PRODUCT_LABEL] = spec.resources.gpu_product
    if device(isvc) == "cuda":  # GPU nodes are commonly tainted for GPU workloads only
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        # Service links would inject <SERVICE>_PORT variables, e.g. KUBEINFER_PORT for a
        # Service named "kubeinfer", clashing with the engine's own env-var flags.
        "enableServiceLinks": False, "automountServiceAccountToken": False,
        "securityContext": restricted_pod(), "initContainers": mounts.init_containers,
        "containers": [container], "volumes": volumes,
        "terminationGracePeriodSeconds":
            PRE_STOP_SECONDS + spec.rollout.drain_seconds + GRACE_MARGIN_SECONDS,
        "nodeSelector": node_selector, "tolerations": tolerations,
    }
    affinity = cache_affinity(isvc, spec.affinity)
    if affinity:
        pod["affinity"] = affinity
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.lora_enabled and role != "worker":  # no traffic before the operator has loaded the adapters
        pod["readinessGates"] = [{"conditionType": api.ADAPTERS_GATE}]
    return {k: v for k, v in pod.items() if v != [] and v != {}}


def scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(api.HTTP_PORT), "prometheus.io/path": "/metrics"}


def workload(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The engines: a Deployment of single-pod replicas, or a LeaderWorkerSet of pod groups."""
    return leader_worker_set(isvc, config) if isvc.spec.multi_pod else deployment(isvc, config)


def leader_worker_set(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """One LWS group per replica (size = pods per replica, replicas = groups; the scale
    subresource writes spec.replicas here as for a Deployment). Any pod's restart recreates its
    group, so no group ever serves with ranks missing or of two generations, and a rolling
    update replaces whole groups. Only the leader carries the engine labels."""
    rollout = isvc.spec.rollout
    metadata = isvc.metadata()
    if isvc.spec.exclusive_topology:
        metadata["annotations"] = {api.LWS_EXCLUSIVE_TOPOLOGY: isvc.spec.exclusive_topology}
    return {
        "apiVersion": api.LWS_API_VERSION, "kind": api.LWS_KIND, "metadata": metadata,
        "spec": {
            "replicas": isvc.spec.replicas, "startupPolicy": "LeaderCreated",
            # a headless Service per group (`<name>-<group>`): the shared one LWS would otherwise
            # create is named like the LWS, i.e. like the InferenceService's own Service
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}},
            "leaderWorkerTemplate": {
                "size": isvc.spec.engine.pods_per_replica, "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": isvc.labels,
                                                "annotations": {**scrape_annotations(), **tenancy_annotations(isvc)}},
                                   "spec": pod_spec(isvc, config, "leader")},
                "workerTemplate": {"metadata": {"labels": isvc.worker_labels,
                                                **({"annotations": tenancy_annotations(isvc)}
                                                   if isvc.spec.tenancy.inline else {})},
                                   "spec": pod_spec(isvc, config, "worker")},
            },
        },
    }


def deployment(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The engine Deployment; replicas come from spec.replicas (the scale subresource)."""
    rollout = isvc.spec.rollout
    annotations = {**scrape_annotations(), **tenancy_annotations(isvc)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": isvc.metadata(),
        "spec": {
            "replicas": isvc.spec.replicas, "selector": {"matchLabels": isvc.selector_labels},
            "revisionHistoryLimit": 3, "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}},
            "template": {"metadata": {"labels": isvc.labels, "annotations": annotations},
                         "spec": pod_spec(isvc, config)},
        },
    }
