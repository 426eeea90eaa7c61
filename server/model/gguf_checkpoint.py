"""Read a GGUF file (llama.cpp's format): config and tokenizer from metadata, weights dequantized,
and the raw blocks of the matrices `quant_linear_cpu` can run on in their quantized form.

llama.cpp's converter permutes the rows of `attn_q`/`attn_k` of `llama` models for its rotary
layout (pairs interleaved instead of halves); we undo that so weights match transformers'.
"""

from __future__ import annotations

import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from kubeinfer.kernels.quant_linear_cpu import BLOCK_BYTES

from .checkpoint import Checkpoint, QuantizedBlocks, one_intra_op_thread
from .config import ModelConfig
from .gguf_dequant import dequantize
from .gguf_reader import GGUFFile
from .tokenizer_files import gguf_eos_ids, gguf_tokenizer

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# GGUF `general.sampling.*` keys (recent converters) -> our generation default names
_SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}
LOAD_WORKERS = 4   # at most this many dequantizing threads
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not match or match[2] not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, 2) back to (2 halves, pair)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def read_gguf_file(path: Path) -> Checkpoint:
    gguf = GGUFFile(path)
    meta = gguf.metadata
    config = ModelConfig.from_gguf(meta, set(gguf.tensors))
    config.eos_token_ids = gguf_eos_ids(meta)
    tokenizer = gguf_tokenizer(meta)
    defaults = {ours: meta[f"general.sampling.{key}"] for key, ours in _SAMPLING_KEYS.items()
                if f"general.sampling.{key}" in meta}
    permuted_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    quantized: QuantizedBlocks = {}

    def convert(name: str, dtype: torch.dtype) -> tuple[str, torch.Tensor]:
        tensor = gguf.tensors[name]
        value = dequantize(tensor, torch.float32 if name == "rope_freqs.weight" else dtype)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        unpermute = config.architecture == "llama" and kind in permuted_heads
        if unpermute:
            value = unpermute_rope_rows(value, permuted_heads[kind])
        if tensor.qtype.name in BLOCK_BYTES and len(tensor.shape) == 2:   # the raw blocks too (a view)
            blocks = torch.from_numpy(np.ascontiguousarray(tensor.data))
            blocks = blocks.reshape(tensor.shape[0], -1, BLOCK_BYTES[tensor.qtype.name])
            quantized[hf_name(name)] = (tensor.qtype.name,
                                        unpermute_rope_rows(blocks, permuted_heads[kind]) if unpermute else blocks)
        return hf_name(name), value

    def weights(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in file order, dequantized a few ahead by one worker per core, each on one
        intra-op thread (torch kernels release the GIL; no thread barriers, see `one_intra_op_thread`)."""
        workers = max(1, min(LOAD_WORKERS, torch.get_num_threads()))
        with one_intra_op_thread(), ThreadPoolExecutor(workers, thread_name_prefix="kubeinfer-gguf") as pool:
            ahead: deque[Future[tuple[str, torch.Tensor]]] = deque()
            for name in gguf.tensors:
                ahead.append(pool.submit(convert, name, dtype))
                if len(ahead) > 2 * workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()

    return Checkpoint(config=config, tokenizer=tokenizer, generation_defaults=defaults,
                      name=_QUANT_SUFFIX.sub("", path.stem), num_tensors=len(gguf.tensors), weights=weights,
                      quantized=quantized)
