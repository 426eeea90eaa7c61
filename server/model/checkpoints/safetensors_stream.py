"""A .safetensors file's tensors as views of the file's pages, front to back, with the disk reading
ahead of the copy.

Why not `safe_open(...).get_tensor`: on the CPU it copies each tensor out of its memory map into
a new tensor, which the loader then copies into the parameter: every byte crosses memory twice
and 2x the tensor's pages are touched for the first time. Here a tensor is a view of the mapped
file (copy-on-write, so nothing can write the file), the parameter's `copy_` is the only copy,
and only the parameters hold anonymous memory. The disk reads ahead of the copy through
`weights.prefetch` (the loader starts it), so the two overlap instead of taking turns. The
format is safetensors' own: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the data.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch

HEADER_LIMIT = 100 << 20   # safetensors' own bound on the header

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
          "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {size} bytes (corrupt file?)")
        return 8 + size, json.loads(f.read(size))


def tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `path` in file order; each tensor is a read-only-backed,
    copy-on-write view of the file's pages: copy it where it belongs."""
    start, header = _header(path)
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    with open(path, "rb") as f:
        length = f.seek(0, 2)
        if length == 0 or not entries:
            return
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped.madvise(mmap.MADV_SEQUENTIAL)
    for name, info in entries:
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which is not supported")
        first, end = (start + offset for offset in info["data_offsets"])
        shape = info["shape"]
        count = math.prod(shape)
        if end > length or end - first != count * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name} ({info['dtype']} {shape}) does not fit its data_offsets")
        if count == 0:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        yield name, torch.frombuffer(mapped, dtype=dtype, count=count, offset=first).view(shape)
