"""`load_model`: resolve source, device and dtype, then build the model and stream its weights in.

The model is built straight on the target device in the target dtype with `torch.nn.init`
skipped (no random init of weights that are overwritten anyway); each stage logs one line with
its timing.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from .checkpoints.checkpoint import Checkpoint, one_intra_op_thread
from .checkpoints.gguf_checkpoint import read_gguf_file
from .checkpoints.hf_checkpoint import read_hf_directory
from .checkpoints.pooling import with_causal_lm_names
from .checkpoints.tokenizer_files import embedded_model_path
from .config import ModelConfig
from .families.causal_lm import CausalLM
from .layers.attention import get_attention_backend
from .layers.kv_cache_quant import KVScales, split_kv_scales
from .quantization import QuantizedLoad, gguf_blocks, resolve_for_checkpoint
from .quantization.lm_head import quantize_lm_head
from .registry import model_family
from .tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    generation_defaults: dict
    name: str
    dtype: torch.dtype
    device: torch.device
    # fp8 KV-cache scales the checkpoint carries, by attention module name (`kv_cache_quant`)
    kv_scales: dict[str, KVScales] = field(default_factory=dict)
    # decoder layers whose KV this process caches (a pipeline stage's); None = all the config's
    kv_cache_layers: int | None = None


class DeviceUnavailableError(ValueError):
    """The requested device does not exist here: a restart on the same node cannot fix it."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else \
            f"torch (CUDA {torch.version.cuda}) sees no GPU: is the NVIDIA driver there and does the " \
            f"container runtime expose the GPUs? CUDA_VISIBLE_DEVICES=" \
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
        raise DeviceUnavailableError(f"device {name!r} requested but CUDA is not available ({why}); "
                                     "use device 'cpu' or 'auto'")
    return device


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMM runs several times faster than float32 on such CPUs."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    if name == "float16" and device.type != "cuda":
        raise ValueError("dtype float16 is only supported on CUDA; on CPU use bfloat16 or float32")
    return _DTYPES[name]


class _SkipInit(TorchFunctionMode):
    """Turns `torch.nn.init.*` into no-ops: the checkpoint overwrites every parameter anyway."""

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


@contextmanager
def uninitialized_modules(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside get uninitialised `dtype` parameters on `device`. NOTE: not the meta
    device + `to_empty()`: on meta tensors, `nn.Embedding`'s `normal_` and `to_empty`'s
    `empty_like` run torch._refs, whose first calls import torch._dynamo and sympy-based shape
    code: 2.3 s of the 4 s load of the embedded model on this CPU."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _SkipInit():
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def fill_model(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device,
               hook: QuantizedLoad | None = None) -> float:
    """Stream checkpoint tensors into a model built under `uninitialized_modules`, freeze it and
    prepack its GEMM weights (the steps every loader shares); returns the prepack's seconds.
    With a quantization `hook` (prepared), its linear layers get their quantized form instead."""
    model.reset_rotary(device)   # float32 again after the model's .to(dtype)
    if hook is not None:
        weights = hook.divert(weights)
    model.load_weights((name, tensor.to(device)) for name, tensor in weights)
    if hook is not None:
        hook.finish(device)
    model.requires_grad_(False).eval()
    start = time.perf_counter()
    with one_intra_op_thread():   # ~120 small reorders: 0.1 s instead of ~1 s of thread barriers
        model.pack_weights()
    return time.perf_counter() - start


def read_checkpoint(source: str) -> Checkpoint:
    path = embedded_model_path() if source == "embedded" else Path(source).expanduser()
    if path.is_dir():
        return read_hf_directory(path)
    if path.is_file() and path.suffix == ".gguf":
        return read_gguf_file(path)
    raise FileNotFoundError(f"model source {source!r}: expected 'embedded', a Hugging Face model directory "
                            "or a .gguf file")


def load_model(source: str = "embedded", dtype: str = "auto", device: str = "auto",
               quantization: str = "auto", embed: bool = False, quantize_head: str = "none") -> LoadedModel:
    """Build the model of `source` on `device` in `dtype`; with quantization 'auto', GGUF matrices
    in a type the CPU kernel reads keep that form too (CPU, bf16, kernel available), and the
    linear layers of a quantized HF checkpoint stay quantized (see `quantization/`). `embed`: an
    embedding model, which needs no LM head and may be saved as the bare decoder (`pooling.py`).
    `quantize_head`: --quantize-lm-head (`quantization/lm_head.py`)."""
    start = time.perf_counter()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    checkpoint = read_checkpoint(source)
    if embed:   # the decoder only: no lm_head parameter, checkpoint names as the causal LM's
        checkpoint.config.tie_word_embeddings = True
        stream = checkpoint.weights
        checkpoint.weights = lambda dtype: with_causal_lm_names(stream(dtype))
    config = checkpoint.config
    method = resolve_for_checkpoint(checkpoint, quantization)
    logger.info("model %s: %s, %d layers, hidden %d; config and tokenizer read in %.2fs", checkpoint.name,
                config.architecture, config.num_hidden_layers, config.hidden_size, time.perf_counter() - start)

    stage = time.perf_counter()
    # NOTE: a quantized model is built on the meta device and only the layers that stay dense
    # are allocated, so the dense weights of the quantized layers never take memory (on CUDA the
    # caching allocator would hold them: a 70B AWQ model would need its bf16 size first).
    with uninitialized_modules(torch_device if method is None else torch.device("meta"), torch_dtype):
        model = model_family(config.architecture).build(
            config, get_attention_backend(torch_device, config.sliding_window)).to(torch_dtype)
    hook = None
    if method is not None:
        hook = QuantizedLoad(method, model)
        hook.prepare()
        model = model.to_empty(device=torch_device)
    built = time.perf_counter()
    kv_scales: dict[str, KVScales] = {}
    pack_seconds = fill_model(model, split_kv_scales(checkpoint.weights(torch_dtype), kv_scales), torch_device, hook)
    end = time.perf_counter()
    weighted = end - pack_seconds
    logger.info("loaded %d tensors as %s on %s in %.2fs (build %.2fs, weights %.2fs, prepack %.2fs; total %.2fs)%s",
                checkpoint.num_tensors, str(torch_dtype).removeprefix("torch."), torch_device, end - stage,
                built - stage, weighted - built, end - weighted, end - start,
                "" if method is None else f"; linear layers quantized with {method.name}")
    blocks = gguf_blocks(checkpoint, quantization, torch_device, torch_dtype)   # set aside while the weights streamed
    if blocks is not None:
        stage = time.perf_counter()
        count = blocks.attach(model)
        logger.info("%d linear layers keep their GGUF quantization for decode (%.2fs)", count,
                    time.perf_counter() - stage)
    if not embed:
        quantize_lm_head(model, quantize_head)
    config.eos_token_ids = checkpoint.tokenizer.eos_token_ids
    return LoadedModel(model=model, config=config, tokenizer=checkpoint.tokenizer,
                       generation_defaults=checkpoint.generation_defaults, name=checkpoint.name,
                       dtype=torch_dtype, device=torch_device, kv_scales=kv_scales)
