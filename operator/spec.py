"""`InferenceService.spec`: pydantic models that are the single source of the API.

`crd.py` turns these models into the CRD's OpenAPI schema (descriptions, defaults, enums,
bounds and CEL rules all come from here), and the builders read validated instances of them.
Engine defaults are read from `kubeinfer.server.flags`, so the CRD and `kubeinfer serve` agree.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS, Flag
from kubeinfer.server.router.flags import STRATEGIES, routing_flag
from kubeinfer.server.tenancy import DEFAULT_PRIORITY_RANGE, TENANT_NAME_PATTERN

MODEL_SOURCE_PATTERN = (r"^(embedded|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?"
                        r"|hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+(@[-A-Za-z0-9_./]+)?"
                        r"|s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/[^\s@]*)?)$")
URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# An adapter lives on a claim its pods mount, so it can be loaded into a running pod (an hf://
# repository would need a download inside every running pod; see operator/adapters.py).
ADAPTER_SOURCE_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?$"
ADAPTER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"
MAX_ADAPTERS = 64


def flag(dest: str) -> Flag:
    """The engine/server flag behind a spec field (KeyError if the flag table lost it)."""
    return {f.dest: f for f in ENGINE_FLAGS + SERVER_FLAGS}[dest]


def rules(*pairs: tuple[str, str]) -> dict[str, Any]:
    """CEL rules (rule, message) in the CRD's `x-kubernetes-validations` form."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in pairs]}


def _match(pattern: str, what: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if isinstance(value, str) and not re.match(pattern, value):
            raise ValueError(f"{value!r} is not {what}")
        return value
    return AfterValidator(check)


def unique_names(what: str) -> AfterValidator:
    """A list whose items' `name`s must differ (the twin of a CEL `exists_one` rule), naming the repeats."""
    def check(items: list[Any]) -> list[Any]:
        names = [item.name for item in items]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"{what} must be unique; repeated: {', '.join(duplicates)}")
        return items
    return AfterValidator(check)


# Quantities and rollout budgets accept `2` as well as `"500m"`, like core Kubernetes fields.
IntOrString = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True})]
Quantity = Annotated[int | str, _match(QUANTITY_PATTERN, "a quantity such as 2, 500m or 8Gi"),
                     WithJsonSchema({"x-kubernetes-int-or-string": True,
                                     "pattern": QUANTITY_PATTERN})]
# Core Kubernetes objects we pass through untouched (EnvVar, Toleration, Affinity).
KubeObject = Annotated[dict[str, Any], WithJsonSchema(
    {"type": "object", "x-kubernetes-preserve-unknown-fields": True})]


class Section(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def section(model: type[Section], description: str) -> Any:
    """A nested object present even when omitted. Its CRD default is spelled out in full: the
    API server checks a default against the object's CEL rules without filling it in first."""
    default = model().model_dump(mode="json", by_alias=True, exclude_none=True)
    return Field(default_factory=model, description=description,
                 json_schema_extra={"default": default})


class SecretKeyRef(Section):
    """A key of a Secret in the InferenceService's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=SECRET_NAME_PATTERN,
                      description="Secret name.")
    key: str = Field("token", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN,
                     description="Key in the Secret.")


class ApiKeySecretRef(SecretKeyRef):
    """A key of a Secret in the InferenceService's namespace holding API keys."""

    key: str = Field("api-keys", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN,
                     description="Key in the Secret. Its value holds the API keys, one per line "
                                 "or comma-separated; '#' lines are comments.")


class ModelCacheSpec(Section):
    """Warm-ahead: the weights fetched into the node cache before any replica needs them."""

    nodes: int = Field(0, ge=0, le=1000,
                       description="Nodes (of those the engine may run on) that hold the weights ahead of "
                                   "scale-up: a Job per node fills its cache, the node gets the label "
                                   "models.kubeinfer.io/<key>, and engine pods prefer such nodes.")


class ModelSpec(Section):
    """Which weights to serve and how."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("!has(self.tokenSecretRef) || self.source.startsWith('hf://')",
         "model.tokenSecretRef only applies to hf:// sources"),
        ("!has(self.credentialsSecret) || self.source.startsWith('s3://')",
         "model.credentialsSecret only applies to s3:// sources"),
        ("!has(self.endpoint) || self.source.startsWith('hf://') || self.source.startsWith('s3://')",
         "model.endpoint only applies to hf:// and s3:// sources")))
    source: Annotated[str, _match(MODEL_SOURCE_PATTERN, "a model source")] = Field(
        "embedded", max_length=512,
        description="'embedded' (SmolLM2-135M-Instruct shipped in the image), "
                    "'pvc://<claim>/<path>' (a Hugging Face directory or a .gguf file on a "
                    "PersistentVolumeClaim, mounted read-only), 'hf://<org>/<name>[@<revision>]' "
                    "(a Hugging Face Hub repository at a branch, tag or commit; the operator resolves "
                    "it to a commit once per generation) or 's3://<bucket>/<prefix>' (the objects under "
                    "a prefix of an S3-compatible bucket). hf:// and s3:// weights are fetched once per "
                    "node into the node's model cache and mounted read-only.",
        json_schema_extra=rules((f"self.matches(r'{MODEL_SOURCE_PATTERN}')",
                                 "model.source must be 'embedded', 'pvc://<claim>/<path>', "
                                 "'hf://<org>/<name>[@<revision>]' or 's3://<bucket>/<prefix>'")))
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret holding a Hugging Face token, for gated hf:// models.")
    credentials_secret: str | None = Field(
        None, min_length=1, max_length=253, pattern=SECRET_NAME_PATTERN,
        description="s3:// only: a Secret whose keys become the fetcher's environment "
                    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optionally AWS_SESSION_TOKEN, AWS_REGION).")
    endpoint: Annotated[str, _match(URL_PATTERN, "an http(s) URL")] | None = Field(
        None, max_length=1024, pattern=URL_PATTERN,
        description="hf://: a Hub mirror (HF_ENDPOINT; default: the chart's modelCache.hfEndpoint, else "
                    "huggingface.co). s3://: the S3-compatible endpoint URL (default: AWS).")
    cache: ModelCacheSpec = section(ModelCacheSpec, ModelCacheSpec.__doc__ or "")
    served_name: str | None = Field(None, min_length=1, max_length=128,
                                    description=flag("served_model_name").help)
    dtype: Literal[flag("dtype").choices] = Field(  # type: ignore[valid-type]
        flag("dtype").default, description=flag("dtype").help)
    max_model_len: int | None = Field(None, ge=16, le=1 << 20,
                                      description=flag("max_model_len").help)
    task: Literal["generate", "embed"] | None = Field(
        None, description="generate: /v1/completions and /v1/chat/completions; embed: /v1/embeddings only "
                          "(an embedding model, pooled as its sentence-transformers config says). "
                          "Unset: embed for a checkpoint of the bare decoder (architectures like "
                          "MistralModel), else generate.")


class PrefixCacheSpec(Section):
    """Radix-tree prefix cache: requests sharing a prompt prefix reuse its KV blocks."""

    enabled: bool = Field(flag("enable_prefix_caching").default,
                          description=flag("enable_prefix_caching").help)


class LoraSpec(Section):
    """LoRA adapter serving (vLLM's --enable-lora and its limits), for spec.adapters."""

    enabled: bool | None = Field(
        None, description="Start the engines with LoRA support. Default: on when spec.adapters "
                          "names any adapter. Set it to true to add the first adapters later "
                          "without a restart (turning LoRA on or off restarts the pods).")
    max_loras: int = Field(flag("max_loras").default, ge=1, le=256, description=flag("max_loras").help)
    max_lora_rank: int = Field(flag("max_lora_rank").default, ge=1, le=1024,
                               description=flag("max_lora_rank").help)
    max_cpu_loras: int | None = Field(None, ge=1, le=4096, description=flag("max_cpu_loras").help)


class AdapterSpec(Section):
    """A LoRA adapter (PEFT format: adapter_config.json + adapter_model.safetensors) of the model."""

    name: str = Field(min_length=1, max_length=63, pattern=ADAPTER_NAME_PATTERN,
                      description="The model id clients send to use this adapter "
                                  "(`model` in requests, listed by /v1/models with the base "
                                  "model as its parent): lowercase letters, digits, '-', '_' and "
                                  "'.', starting and ending with a letter or digit.")
    source: Annotated[str, _match(ADAPTER_SOURCE_PATTERN, "an adapter source")] = Field(
        max_length=512,
        description="'pvc://<claim>/<path>': the adapter's directory on a "
                    "PersistentVolumeClaim, mounted read-only. Pods mount every claim their "
                    "adapters name, so adding or removing adapters on claims already in use "
                    "(the model's or another adapter's) loads or unloads them in the running "
                    "pods without a restart; a claim no pod mounts yet (or dropping a claim's "
                    "last adapter) changes the pods' volumes, which rolls them once.",
        json_schema_extra=rules((f"self.matches(r'{ADAPTER_SOURCE_PATTERN}')",
                                 "adapters[].source must be 'pvc://<claim>/<path>': adapters are "
                                 "loaded into running pods, so they must be on a volume the pods "
                                 "mount (hf:// cannot be fetched into a running pod)")))


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
PVC_SOURCE_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^\s]+$"


class SpeculativeSpec(Section):
    """Speculative decoding (`--speculative-config`, vLLM's): a proposer drafts tokens that the
    model verifies in one pass. Greedy output is unchanged; sampled output keeps its distribution."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("self.method == 'draft_model' ? has(self.draftModel) : !has(self.draftModel)",
         "engine.speculative.draftModel is required by method draft_model and applies to no other method"),
        ("self.method == 'ngram' || (!has(self.promptLookupMin) && !has(self.promptLookupMax))",
         "engine.speculative.promptLookupMin/Max apply to method ngram only"),
        ("!has(self.promptLookupMin) || !has(self.promptLookupMax) || self.promptLookupMin <= self.promptLookupMax",
         "engine.speculative.promptLookupMin must not exceed promptLookupMax")))
    method: Literal[SPECULATIVE_METHODS] = Field(  # type: ignore[valid-type]
        description="ngram: prompt lookup (the tokens that followed the last n tokens earlier in the "
                    "prompt or output); suffix: the most frequent continuation in this request and in "
                    "earlier responses of the same engine; draft_model: a smaller model with the same "
                    "tokenizer (draftModel).")
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="Most draft tokens per sequence and step.")
    prompt_lookup_min: int | None = Field(None, ge=1, le=64,
                                          description="ngram: shortest n-gram looked up (default 5, vLLM's).")
    prompt_lookup_max: int | None = Field(None, ge=1, le=64,
                                          description="ngram: longest n-gram looked up, tried first (default: min).")
    draft_model: Annotated[str, _match(PVC_SOURCE_PATTERN, "a pvc://<claim>/<path> source")] | None = Field(
        None, max_length=512,
        description="draft_model: 'pvc://<claim>/<path>', a Hugging Face directory or .gguf with the model's "
                    "tokenizer, mounted read-only (the model's claim is reused).",
        json_schema_extra=rules((f"self.matches(r'{PVC_SOURCE_PATTERN}')",
                                 "engine.speculative.draftModel must be 'pvc://<claim>/<path>'")))
    disable_by_batch_size: int | None = Field(
        None, ge=1, le=4096, description="No drafts in a step with more running sequences than this "
                                         "(default 8: measured on CPU, see BENCHMARKS.md).")

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeSpec":
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("engine.speculative.draftModel is required by method draft_model and "
                             "applies to no other method")
        if self.method != "ngram" and (self.prompt_lookup_min or self.prompt_lookup_max):
            raise ValueError("engine.speculative.promptLookupMin/Max apply to method ngram only")
        if self.prompt_lookup_min and self.prompt_lookup_max and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("engine.speculative.promptLookupMin must not exceed promptLookupMax")
        return self


class EngineSpec(Section):
    """The serving engine each pod runs (`kubeinfer serve`)."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("(self.tensorParallelSize * self.pipelineParallelSize) % self.podsPerReplica == 0",
         "engine.tensorParallelSize x engine.pipelineParallelSize ranks must spread evenly over "
         "engine.podsPerReplica pods"),
        ("self.tensorParallelSize * self.pipelineParallelSize / self.podsPerReplica <= 8",
         "engine.tensorParallelSize x engine.pipelineParallelSize / engine.podsPerReplica is the GPUs each "
         "pod asks for: at most 8 (a node); spread the ranks over more pods"),
        ("self.podsPerReplica == 1 || !has(self.speculative) || self.speculative.method != 'draft_model'",
         "engine.speculative.method draft_model runs on one pod: use ngram or suffix with podsPerReplica > 1")))

    image: str | None = Field(None, max_length=512,
                              description="Engine image (default: the operator's --engine-image).")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="cuda requests tensorParallelSize GPUs per pod; cpu requests none; "
                            "auto is cuda when resources.gpuProduct names a GPU, cpu otherwise.")
    tensor_parallel_size: int = Field(
        flag("tensor_parallel_size").default, ge=1, le=8,
        description="Ranks (one GPU each) that share every layer; must divide the model's attention heads. "
                    "Keep it within a node (NVLink): see docs/multi-node.md.")
    pipeline_parallel_size: int = Field(
        flag("pipeline_parallel_size").default, ge=1, le=16,
        description="Pipeline stages, each holding a consecutive run of the model's layers (Llama-shaped "
                    "families); a replica has tensorParallelSize x pipelineParallelSize ranks, one GPU each.")
    pods_per_replica: int = Field(
        1, ge=1, le=16,
        description="Pods one replica spans. 1: a Deployment of single-pod replicas. More: each replica is a "
                    "LeaderWorkerSet group (LWS must be installed) whose leader serves the API and whose "
                    "workers hold the other ranks; each pod asks for tensorParallelSize x "
                    "pipelineParallelSize / podsPerReplica GPUs; the group is created, restarted and "
                    "scaled as one replica.")
    block_size: Literal[8, 16, 32, 64, 128] = Field(flag("block_size").default,
                                                    description=flag("block_size").help)
    quantization: Literal[flag("quantization").choices] = Field(  # type: ignore[valid-type]
        flag("quantization").default, description=flag("quantization").help)
    kv_cache_dtype: Literal[flag("kv_cache_dtype").choices] = Field(  # type: ignore[valid-type]
        flag("kv_cache_dtype").default, description=flag("kv_cache_dtype").help)
    kv_cache_memory_fraction: float = Field(flag("gpu_memory_utilization").default,
                                            ge=0.05, le=0.99,
                                            description=flag("gpu_memory_utilization").help)
    kv_cache_memory: Quantity | None = Field(None, description=flag("kv_cache_memory").help)
    max_num_seqs: int = Field(flag("max_num_seqs").default, ge=1, le=4096,
                              description=flag("max_num_seqs").help)
    max_num_batched_tokens: int = Field(flag("max_num_batched_tokens").default, ge=16,
                                        le=1 << 20, description=flag("max_num_batched_tokens").help)
    prefix_cache: PrefixCacheSpec = section(PrefixCacheSpec, PrefixCacheSpec.__doc__ or "")
    lora: LoraSpec = section(LoraSpec, LoraSpec.__doc__ or "")
    speculative: SpeculativeSpec | None = Field(None, description=SpeculativeSpec.__doc__ or "")
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64,
        description="Extra `kubeinfer serve` arguments, appended after the generated ones.")
    env: list[KubeObject] = Field(default_factory=list, max_length=64,
                                  description="Extra environment variables (core EnvVar objects).")


class ResourcesSpec(Section):
    """Compute per replica. The GPU count is not set here: it is engine.tensorParallelSize."""

    gpu_product: str | None = Field(
        None, max_length=128,
        description="GPU model to run on, matched against the node label nvidia.com/gpu.product "
                    "(e.g. NVIDIA-A100-SXM4-80GB).")
    cpu: Quantity = Field("1", description="CPU request per replica.")
    memory: Quantity = Field("4Gi", description="Memory request and limit per replica.")


class AutoscalingSpec(Section):
    """Built-in autoscaler sizing spec.replicas from the engines' own load signals."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("self.minReplicas <= self.maxReplicas",
         "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"),
        ("self.metric != 'kvCacheUsage' || self.target <= 1.0",
         "autoscaling.target is a fraction (0-1] when the metric is kvCacheUsage"),
        ("self.windowSeconds >= self.intervalSeconds",
         "autoscaling.windowSeconds must be at least autoscaling.intervalSeconds")))
    enabled: bool = Field(False, description="Off: replicas are left to the user, HPA or KEDA.")
    min_replicas: int = Field(1, ge=0, le=1000,
                              description="Lower bound; 0 scales to zero when idle.")
    max_replicas: int = Field(3, ge=1, le=1000, description="Upper bound.")
    metric: Literal["queueDepth", "inFlight", "kvCacheUsage"] = Field(
        "queueDepth", description="queueDepth: vllm:num_requests_waiting; inFlight: waiting + "
                                  "running; kvCacheUsage: vllm:kv_cache_usage_perc.")
    target: float = Field(4.0, gt=0, le=1e6,
                          description="Per-replica value of the metric to aim for; desired "
                                      "replicas = ceil(sum over pods / target).")
    interval_seconds: int = Field(10, ge=1, le=3600, description="How often pods are scraped.")
    window_seconds: int = Field(60, ge=1, le=3600,
                                description="The metric is averaged over this window.")
    scale_down_delay_seconds: int = Field(
        300, ge=0, le=86400,
        description="Scale down only after proposals stayed lower for this long.")
    max_scale_up_factor: float = Field(
        2.0, ge=1.0, le=100.0,
        description="One step grows replicas at most this much (and always by at least 1).")
    activation_timeout_seconds: int = Field(
        120, ge=1, le=3600,
        description="At zero replicas, how long a request is held while a pod starts before "
                    "it gets 503 with Retry-After.")


class RolloutSpec(Section):
    """How spec changes roll out to running replicas."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
         "rollout.maxSurge and rollout.maxUnavailable cannot both be 0")))
    max_surge: IntOrString = Field(1, description="Extra pods allowed during a rollout "
                                                  "(count or percentage).")
    max_unavailable: IntOrString = Field(0, description="Pods allowed to be unavailable during "
                                                        "a rollout (count or percentage).")
    drain_seconds: int = Field(int(flag("shutdown_timeout").default), ge=0, le=3600,
                               description=flag("shutdown_timeout").help)


class AuthSpec(Section):
    """Who may call the OpenAI routes of this service."""

    api_key_secret_ref: ApiKeySecretRef | None = Field(
        None, description="Secret holding the API keys clients must send as 'Authorization: "
                          "Bearer <key>' (engines and the scale-from-zero gateway check them). "
                          "They reach the pods as an env var from the Secret, never as an "
                          "argument. Probes, /metrics, /version, /openapi.json, /kv/blocks and "
                          "/tokenizer_info stay open. Pods read the keys when they start: restart them after "
                          "changing the Secret. Unset: no key needed.")


class TenantsSecretRef(SecretKeyRef):
    """A key of a Secret in the InferenceService's namespace holding the tenant file."""

    key: str = Field("tenants.yaml", min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN,
                     description="Key in the Secret. Its value is the tenant file (YAML or JSON): "
                                 "tenants with name, keys, priority and quotas {tokens_per_minute, "
                                 "requests_per_minute}; optional priority_range and objectives.")


MAX_TENANTS = 64
PRIORITY_BOUND = 1_000_000   # any priority the spec may name lies within +/- this
DEFAULT_LOW, DEFAULT_HIGH = DEFAULT_PRIORITY_RANGE
# The range in force, in CEL: priorityRange when set, else the tenant file's default.
_LOW = f"(has(self.priorityRange) ? self.priorityRange.min : {DEFAULT_LOW})"
_HIGH = f"(has(self.priorityRange) ? self.priorityRange.max : {DEFAULT_HIGH})"


class TenantQuotasSpec(Section):
    """Per-minute limits of one tenant, enforced by every engine and (each its share) router replica."""

    tokens_per_minute: int | None = Field(None, ge=1, le=1 << 40,
                                          description="Prompt plus generated tokens per minute. Unset: no limit.")
    requests_per_minute: int | None = Field(None, ge=1, le=1 << 40,
                                            description="Requests per minute. Unset: no limit.")


class TenantSpec(Section):
    """One tenant: its name (the metrics' tenant label), its priority and quotas, and the Secret
    holding its API keys (the keys never enter the InferenceService)."""

    name: str = Field(min_length=1, max_length=63, pattern=TENANT_NAME_PATTERN,
                      description="The tenant's name: letters, digits, '-', '_' and '.', starting and "
                                  "ending with a letter or digit; unique in the table. A trusted gateway "
                                  "names the tenant with it (x-gateway-inference-fairness-id).")
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND,
                          description="Its requests' default priority and the best (lowest) they may ask "
                                      "for; lower is served first. Within priorityRange.")
    quotas: TenantQuotasSpec = section(TenantQuotasSpec, TenantQuotasSpec.__doc__ or "")
    api_keys_secret_ref: ApiKeySecretRef | None = Field(
        None, description="Secret holding the tenant's API keys: mounted read-only into the engine and "
                          "router pods (the operator never reads it). Unset: only a trusted gateway's "
                          "header names this tenant.")


class PriorityRangeSpec(Section):
    """The bounds of any request's priority (lower is served first)."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("self.min <= self.max", "tenancy.priorityRange.min must not exceed tenancy.priorityRange.max")))
    min: int = Field(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND, description="The best priority.")
    max: int = Field(ge=-PRIORITY_BOUND, le=PRIORITY_BOUND, description="The worst priority.")


class TenancySpec(Section):
    """Tenants sharing this service (docs/tenancy.md): API keys name tenants, which the engines
    schedule fairly by priority then tokens, and which engines and routers hold to their quotas
    and meter per tenant."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("!has(self.tenantsSecretRef) || ((!has(self.tenants) || size(self.tenants) == 0) && "
         "!has(self.priorityRange) && (!has(self.objectives) || size(self.objectives) == 0))",
         "tenancy.tenantsSecretRef and the inline table (tenancy.tenants, priorityRange, objectives) "
         "are mutually exclusive: use one"),
        (f"!has(self.tenants) || self.tenants.all(t, {_LOW} <= t.priority && t.priority <= {_HIGH})",
         "tenancy.tenants[].priority must lie within tenancy.priorityRange (default -100 to 100)"),
        (f"!has(self.objectives) || self.objectives.all(k, {_LOW} <= self.objectives[k] && "
         f"self.objectives[k] <= {_HIGH})",
         "tenancy.objectives must lie within tenancy.priorityRange (default -100 to 100)")))
    tenants_secret_ref: TenantsSecretRef | None = Field(
        None, description="Secret holding the whole tenant file (keys included), mounted read-only into "
                          "the engine and router pods as their --tenants-file. Excludes the inline "
                          "table (tenants, priorityRange, objectives). Pods read it when they start.")
    tenants: Annotated[list[TenantSpec], unique_names("tenancy.tenants[].name")] = Field(
        default_factory=list, max_length=MAX_TENANTS,
        description="The tenant table, inline: names, priorities and quotas here, each tenant's API keys "
                    "in a Secret. The engine and router pods get it without keys as their --tenants-file "
                    "and mount the key Secrets read-only beside it; changing it rolls the pods. Each "
                    "router replica enforces its share of the quotas (quota / routing replicas).",
        json_schema_extra=rules(("self.all(a, self.exists_one(b, b.name == a.name))",
                                 "tenancy.tenants[].name must be unique")))
    priority_range: PriorityRangeSpec | None = Field(
        None, description="Inline table: the bounds of any request's priority (lower is served first). "
                          f"Default: {DEFAULT_LOW} to {DEFAULT_HIGH}.")
    objectives: dict[str, int] = Field(
        default_factory=dict, max_length=MAX_TENANTS,
        description="Inline table: objective names a trusted gateway may send "
                    "(x-gateway-inference-objective) for a priority, e.g. {interactive: 0, batch: 8}.")
    trust_tenant_header: bool = Field(bool(flag("trust_tenant_header").default),
                                      description=flag("trust_tenant_header").help)

    @property
    def inline(self) -> bool:
        """Whether the spec carries a tenant table of its own (rendered for the pods)."""
        return bool(self.tenants) or self.priority_range is not None or bool(self.objectives)

    @property
    def bounds(self) -> tuple[int, int]:
        return (self.priority_range.min, self.priority_range.max) if self.priority_range else DEFAULT_PRIORITY_RANGE

    @model_validator(mode="after")
    def _consistent(self) -> "TenancySpec":
        """The CEL rules above, for objects that did not pass an API server."""
        if self.tenants_secret_ref is not None and self.inline:
            raise ValueError("tenancy.tenantsSecretRef and the inline table (tenancy.tenants, priorityRange, "
                             "objectives) are mutually exclusive: use one")
        low, high = self.bounds
        if low > high:
            raise ValueError("tenancy.priorityRange.min must not exceed tenancy.priorityRange.max")
        for tenant in self.tenants:
            if not low <= tenant.priority <= high:
                raise ValueError(f"tenancy.tenants[{tenant.name}].priority {tenant.priority} is outside "
                                 f"tenancy.priorityRange [{low}, {high}]")
        for name, priority in self.objectives.items():
            if not low <= priority <= high:
                raise ValueError(f"tenancy.objectives[{name}] {priority} is outside tenancy.priorityRange "
                                 f"[{low}, {high}]")
        return self


class TracingSpec(Section):
    """OpenTelemetry traces of the engines' requests (docs/tenancy.md#tracing)."""

    otlp_endpoint: str | None = Field(None, max_length=2048, pattern=r"^https?://[^\s]+$",
                                      description=flag("otlp_traces_endpoint").help)
    sampling_ratio: float = Field(flag("otlp_traces_sampling_ratio").default, ge=0, le=1,
                                  description=flag("otlp_traces_sampling_ratio").help)


class RoutingSpec(Section):
    """The router in front of the engines (`kubeinfer route`): which replica serves a request."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("self.strategy == 'none' || !has(self.replicas) || self.replicas >= 1",
         "routing.replicas must be at least 1 unless routing.strategy is none")))
    strategy: Literal[(*STRATEGIES, "none")] = Field(  # type: ignore[valid-type]
        routing_flag("strategy").default,
        description="prefix-aware: the replica holding the longest cached prefix of the request "
                    "(from the engines' published block hashes), minus a load penalty, within "
                    "bounded loads; least-load: fewest requests in flight; round-robin; none: the "
                    "Service goes straight to the engine pods (a scale-from-zero gateway still "
                    "runs at autoscaling.minReplicas 0).")
    replicas: int | None = Field(
        None, ge=0, le=100,
        description="Router pods (a PodDisruptionBudget keeps one up from 2). Default: 2 when the "
                    "service may run 2 or more engine replicas, else 1.")
    load_penalty_tokens: float = Field(routing_flag("load_penalty_tokens").default, ge=0, le=1e6,
                                       description=routing_flag("load_penalty_tokens").help)
    balance_factor: float = Field(routing_flag("balance_factor").default, ge=0, le=100,
                                  description=routing_flag("balance_factor").help)
    balance_slack: float = Field(routing_flag("balance_slack").default, ge=0, le=1e6,
                                 description=routing_flag("balance_slack").help)
    kv_usage_limit: float = Field(routing_flag("kv_usage_limit").default, gt=0, le=1.0,
                                  description=routing_flag("kv_usage_limit").help)
    prefix_key_tokens: int = Field(routing_flag("prefix_key_tokens").default, ge=1, le=1 << 20,
                                   description=routing_flag("prefix_key_tokens").help)
    warmup_prefixes: int = Field(routing_flag("warmup_prefixes").default, ge=0, le=1024,
                                 description=routing_flag("warmup_prefixes").help)
    warmup_tokens: int = Field(routing_flag("warmup_tokens").default, ge=0, le=1 << 24,
                               description=routing_flag("warmup_tokens").help)
    warmup_hold_seconds: float = Field(routing_flag("warmup_hold_seconds").default, ge=0, le=3600,
                                       description=routing_flag("warmup_hold_seconds").help)
    max_in_flight_per_replica: int = Field(routing_flag("max_in_flight_per_replica").default, ge=0, le=1 << 20,
                                           description=routing_flag("max_in_flight_per_replica").help)
    max_queued_requests: int = Field(routing_flag("max_queued_requests").default, ge=1, le=1 << 20,
                                     description=routing_flag("max_queued_requests").help)


class InferencePoolSpec(Section):
    """A Gateway API Inference Extension InferencePool of the engines (docs/gateway-api.md)."""

    enabled: bool = Field(False, description="Render an InferencePool (inference.networking.k8s.io/v1) "
                          "selecting the engine pods (leaders only with multi-pod replicas), and kubeinfer's "
                          "endpoint picker for it (`kubeinfer route --ext-proc-port`: Deployment, Service, "
                          "RBAC), beside the router Service. Needs GIE's InferencePool CRD (the chart's crds.gie).")
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        "FailClose", description="The pool's endpointPickerRef.failureMode: what the gateway does "
                                 "when the picker does not answer.")
    fallback_endpoints: int = Field(0, ge=0, le=16, description="Endpoints listed after the picked one for "
                                    "gateways that retry down the list (0 suits every GIE gateway).")
    replicas: int = Field(1, ge=1, le=10, description="Endpoint-picker pods.")


class InferenceServiceSpec(Section):
    """A model served by a set of identical kubeinfer engine pods behind one Service."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("!has(self.adapters) || !has(self.model.servedName) || "
         "self.adapters.all(a, a.name != self.model.servedName)",
         "adapters[].name must differ from model.servedName: both are model ids clients send"),
        ("!has(self.adapters) || size(self.adapters) == 0 || !has(self.engine.lora.enabled) || "
         "self.engine.lora.enabled",
         "engine.lora.enabled is false but spec.adapters names adapters"),
        ("!has(self.exclusiveTopology) || (has(self.engine) && has(self.engine.podsPerReplica) && "
         "self.engine.podsPerReplica > 1)",
         "exclusiveTopology places the pods of multi-pod replicas: it needs engine.podsPerReplica > 1"),
        ("!has(self.engine) || !has(self.engine.pipelineParallelSize) || self.engine.pipelineParallelSize == 1 || "
         "((!has(self.engine.lora) || !has(self.engine.lora.enabled) || !self.engine.lora.enabled) && "
         "(!has(self.adapters) || size(self.adapters) == 0))",
         "LoRA adapters with engine.pipelineParallelSize > 1 are not supported yet")))
    model: ModelSpec = section(ModelSpec, ModelSpec.__doc__ or "")
    adapters: Annotated[list[AdapterSpec], unique_names("adapter names")] = Field(
        default_factory=list, max_length=MAX_ADAPTERS,
        description="LoRA adapters of the model, served next to it by every replica (a request "
                    "names one as its `model`). Adding or removing one loads or unloads it in "
                    "the running pods through the engines' API, without a restart; "
                    "status.adapters shows which replicas hold each, and the AdaptersReady "
                    "condition carries the engine's error when one fails to load.",
        json_schema_extra=rules(("self.all(a, self.exists_one(b, b.name == a.name))",
                                 "adapters[].name must be unique")))
    engine: EngineSpec = section(EngineSpec, EngineSpec.__doc__ or "")
    resources: ResourcesSpec = section(ResourcesSpec, ResourcesSpec.__doc__ or "")
    replicas: int = Field(1, ge=0, le=1000,
                          description="Engine replicas: pods, or groups of engine.podsPerReplica pods; the scale "
                                      "subresource (kubectl scale, HPA, KEDA, the built-in autoscaler) writes here.")
    autoscaling: AutoscalingSpec = section(AutoscalingSpec, AutoscalingSpec.__doc__ or "")
    rollout: RolloutSpec = section(RolloutSpec, RolloutSpec.__doc__ or "")
    auth: AuthSpec = section(AuthSpec, AuthSpec.__doc__ or "")
    routing: RoutingSpec = section(RoutingSpec, RoutingSpec.__doc__ or "")
    inference_pool: InferencePoolSpec = section(InferencePoolSpec, InferencePoolSpec.__doc__ or "")
    tenancy: TenancySpec = section(TenancySpec, TenancySpec.__doc__ or "")
    tracing: TracingSpec = section(TracingSpec, TracingSpec.__doc__ or "")
    node_selector: dict[str, str] = Field(default_factory=dict,
                                          description="Extra node labels pods must match.")
    tolerations: list[KubeObject] = Field(default_factory=list, max_length=32,
                                          description="Pod tolerations (core Toleration objects).")
    affinity: KubeObject | None = Field(None, description="Pod affinity (core Affinity object).")
    priority_class_name: str | None = Field(None, max_length=253,
                                            description="PriorityClass of the pods.")
    exclusive_topology: str | None = Field(
        None, max_length=317,
        description="Multi-pod replicas (engine.podsPerReplica > 1): a node label key, e.g. "
                    "kubernetes.io/hostname or a rack / NVLink-domain label; each group gets a topology "
                    "domain of its own and never shares it with another group (LWS exclusive placement).")

    @model_validator(mode="after")
    def _ranks_fit(self) -> InferenceServiceSpec:
        """The CEL rules on ranks and pods, for objects that did not pass an API server."""
        engine = self.engine
        ranks = engine.tensor_parallel_size * engine.pipeline_parallel_size
        if ranks % engine.pods_per_replica:
            raise ValueError("engine.tensorParallelSize x engine.pipelineParallelSize ranks must spread evenly "
                             "over engine.podsPerReplica pods")
        if ranks // engine.pods_per_replica > 8:
            raise ValueError("engine.tensorParallelSize x engine.pipelineParallelSize / engine.podsPerReplica is "
                             "the GPUs each pod asks for: at most 8 (a node); spread the ranks over more pods")
        if engine.pods_per_replica > 1 and engine.speculative is not None and engine.speculative.method == "draft_model":
            raise ValueError("engine.speculative.method draft_model runs on one pod: use ngram or suffix with "
                             "podsPerReplica > 1")
        if engine.pipeline_parallel_size > 1 and self.lora_enabled:
            raise ValueError("LoRA adapters with engine.pipelineParallelSize > 1 are not supported yet")
        if self.exclusive_topology is not None and engine.pods_per_replica == 1:
            raise ValueError("exclusiveTopology places the pods of multi-pod replicas: it needs "
                             "engine.podsPerReplica > 1")
        return self

    @property
    def multi_pod(self) -> bool:
        return self.engine.pods_per_replica > 1

    @model_validator(mode="after")
    def _adapters_fit(self) -> InferenceServiceSpec:
        """The CEL rules above, for objects that did not pass an API server."""
        if any(a.name == self.model.served_name for a in self.adapters):
            raise ValueError("adapters[].name must differ from model.servedName: both are model "
                             "ids clients send")
        if self.adapters and self.engine.lora.enabled is False:
            raise ValueError("engine.lora.enabled is false but spec.adapters names adapters")
        return self

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora.enabled if self.engine.lora.enabled is not None else bool(self.adapters)
