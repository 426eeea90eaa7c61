"""Read a GGUF file (llama.cpp's format): config and tokenizer from metadata, weights dequantized,
and the raw blocks of the matrices the CPU's GGUF kernel can run on in their quantized form
(`quantization/gguf.py`).

llama.cpp's converter permutes the rows of `attn_q`/`attn_k` of `llama` models for its rotary
layout (pairs interleaved instead of halves); we undo that so weights match transformers'.
The tensor names and which rows are permuted come from the family (`registry.GGUFNames`);
`convert_tensor` is the one conversion, used by this loader and the tensor-parallel one.
"""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import torch

from kubeinfer.kernels.ops_cpu import GGUF_BLOCK_BYTES

from ..config import ModelConfig
from ..registry import LLAMA_GGUF, GGUFNames, model_family
from .checkpoint import Checkpoint, FusedParts, QuantizedBlocks, Slice, is_fused, one_intra_op_thread, split_fused
from .gguf_dequant import dequantize
from .gguf_reader import GGUFFile, GGUFTensor
from .tokenizer_files import gguf_eos_ids, gguf_tokenizer

# GGUF `general.sampling.*` keys (recent converters) -> our generation default names
_SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}
LOAD_WORKERS = 4   # at most this many dequantizing threads
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def hf_name(gguf_name: str) -> str:
    """The transformers name of a Llama-family GGUF tensor."""
    return LLAMA_GGUF.hf_name(gguf_name)


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, 2) back to (2 halves, pair)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def convert_tensor(names: GGUFNames, gguf_name: str, tensor: GGUFTensor, dtype: torch.dtype, num_heads: int,
                   num_kv_heads: int, part: Slice | None = None) -> tuple[str, torch.Tensor]:
    """One GGUF tensor as its transformers name and value: dequantized to `dtype` (rope_freqs
    stays float32), only the rows of `part` where it splits rows (tensor parallelism; whole
    quantized rows, so a rank dequantizes just its own), q/k rows back in transformers' order.
    `num_heads` / `num_kv_heads` are the heads in the tensor (or in its `part`)."""
    name = names.hf_name(gguf_name)
    target = torch.float32 if name == "rope_freqs.weight" else dtype
    if part is None:
        value = dequantize(tensor, target)
    elif part.dim == 0 and len(tensor.shape) == 2:
        rows = dataclasses.replace(tensor, shape=(part.stop - part.start, tensor.shape[1]),
                                   data=tensor.data[part.start:part.stop])
        value = part.pad(dequantize(rows, target))
    else:
        value = part.pad(dequantize(tensor, target).narrow(part.dim, part.start, part.stop - part.start).clone())
    if names.norm_shift and name.endswith("norm.weight"):
        value = value - names.norm_shift
    heads = names.rope_heads(name, num_heads, num_kv_heads)
    return name, value if heads is None else unpermute_rope_rows(value, heads)


def convert_tensors(names: GGUFNames, gguf_name: str, tensor: GGUFTensor, dtype: torch.dtype, num_heads: int,
                    num_kv_heads: int, slices: Mapping[str, Slice], fused: FusedParts | None = None
                    ) -> list[tuple[str, torch.Tensor]]:
    """`convert_tensor`, except that a stacked expert tensor (`ffn_gate_exps` [E, I, H], ...) becomes
    its E per-expert matrices under their transformers names, and a fused one (Phi-3's `attn_qkv`,
    `fused` from the family) its projections, each cut to its part in `slices` (tensor parallelism)
    -- the names and slices the model and `weight_slices` use for any checkpoint."""
    experts = names.expert_names(gguf_name, tensor.shape[0]) if len(tensor.shape) == 3 else None
    if experts is None:
        name = names.hf_name(gguf_name)
        if fused and is_fused(name, fused):   # whole, split, then each part sliced
            pieces = split_fused(*convert_tensor(names, gguf_name, tensor, dtype, num_heads, num_kv_heads), fused)
            return [(piece_name, piece if (part := slices.get(piece_name)) is None else
                     part.pad(piece.narrow(part.dim, part.start, part.stop - part.start)))
                    for piece_name, piece in pieces]
        return [convert_tensor(names, gguf_name, tensor, dtype, num_heads, num_kv_heads, slices.get(name))]
    stacked = dequantize(tensor, dtype)
    converted = []
    for name, matrix in zip(experts, stacked, strict=True):
        part = slices.get(name)
        converted.append((name, matrix if part is None else
                          part.pad(matrix.narrow(part.dim, part.start, part.stop - part.start))))
    return converted


def read_gguf_file(path: Path) -> Checkpoint:
    gguf = GGUFFile(path)
    meta = gguf.metadata
    config = ModelConfig.from_gguf(meta, set(gguf.tensors))
    config.eos_token_ids = gguf_eos_ids(meta)
    tokenizer = gguf_tokenizer(meta)
    defaults = {ours: meta[f"general.sampling.{key}"] for key, ours in _SAMPLING_KEYS.items()
                if f"general.sampling.{key}" in meta}
    family = model_family(config.architecture)
    names, fused = family.gguf, family.resolve().fused_checkpoint_parts(config)
    heads = (config.num_attention_heads, config.num_key_value_heads)
    quantized: QuantizedBlocks = {}

    def convert(gguf_name: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        tensor = gguf.tensors[gguf_name]
        if len(tensor.shape) == 3:   # stacked experts
            return convert_tensors(names, gguf_name, tensor, dtype, *heads, {})
        name, value = convert_tensor(names, gguf_name, tensor, dtype, *heads)
        if tensor.qtype.name in GGUF_BLOCK_BYTES and len(tensor.shape) == 2:   # the raw blocks too (a view)
            blocks = torch.from_numpy(np.ascontiguousarray(tensor.data))
            blocks = blocks.reshape(tensor.shape[0], -1, GGUF_BLOCK_BYTES[tensor.qtype.name])
            permuted = names.rope_heads(name, *heads)
            blocks = blocks if permuted is None else unpermute_rope_rows(blocks, permuted)
            for piece_name, piece in split_fused(name, blocks, fused):   # quantized along rows: split alike
                quantized[piece_name] = (tensor.qtype.name, piece)
        return split_fused(name, value, fused)

    def weights(dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors in file order, dequantized a few ahead by one worker per core, each on one
        intra-op thread (torch kernels release the GIL; no thread barriers, see `one_intra_op_thread`)."""
        workers = max(1, min(LOAD_WORKERS, torch.get_num_threads()))
        with one_intra_op_thread(), ThreadPoolExecutor(workers, thread_name_prefix="kubeinfer-gguf") as pool:
            ahead: deque[Future[list[tuple[str, torch.Tensor]]]] = deque()
            for name in gguf.tensors:
                ahead.append(pool.submit(convert, name, dtype))
                if len(ahead) > 2 * workers:
                    yield from ahead.popleft().result()
            while ahead:
                yield from ahead.popleft().result()

    return Checkpoint(config=config, tokenizer=tokenizer, generation_defaults=defaults,
                      name=_QUANT_SUFFIX.sub("", path.stem), num_tensors=len(gguf.tensors), weights=weights, gguf=True,
                      quantized=quantized)
