"""A minimal GGUF reader: metadata as Python values, tensors as memory-mapped byte blocks.

`gguf.GGUFReader` builds one numpy view per array element and takes ~7 s on the embedded
model's 49k-token vocabulary; this reader parses the same header in ~0.05 s. Layout (GGUF v2/v3):
magic, version, tensor count, KV count, KV pairs, tensor infos, then aligned tensor data.
The `gguf` package (slow to import, yaml included: BENCHMARKS.md, "Figures that were in code
comments") is only imported for a tensor type that `QType` does not list, i.e. one we cannot
dequantize anyway.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class QType(IntEnum):
    """ggml tensor type ids (`GGMLQuantizationType` values) of the types `gguf_dequant` reads."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    BF16 = 30


# (values per block, bytes per block), as gguf.GGML_QUANT_SIZES
QUANT_SIZES = {QType.F32: (1, 4), QType.F16: (1, 2), QType.Q4_0: (32, 18), QType.Q4_1: (32, 20),
               QType.Q8_0: (32, 34), QType.Q4_K: (256, 144), QType.Q6_K: (256, 210), QType.BF16: (1, 2)}


def _type_and_size(type_id: int) -> tuple[IntEnum, tuple[int, int]]:
    if type_id in QUANT_SIZES:
        return QType(type_id), QUANT_SIZES[QType(type_id)]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType   # a type we only need to skip over

    qtype = GGMLQuantizationType(type_id)
    return qtype, GGML_QUANT_SIZES[qtype]


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]           # row-major (numpy/torch order; GGUF stores it reversed)
    qtype: IntEnum                   # QType, or gguf's GGMLQuantizationType for types we cannot read
    data: np.ndarray                 # raw bytes [rows, bytes_per_row], uint8, memory-mapped


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # Copy-on-write map: torch.from_numpy needs a writable array; nothing is ever written back.
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="c")
        self._raw = memoryview(self._buf)
        self._pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{self.path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        tensor_count, kv_count = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            type_id, offset = self._unpack("<IQ")
            infos.append((name, dims, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            qtype, (block_size, type_size) = _type_and_size(type_id)
            row_bytes = dims[0] // block_size * type_size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            start = data_start + offset
            data = self._buf[start:start + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors[name] = GGUFTensor(name, tuple(int(d) for d in reversed(dims)), qtype, data)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._raw, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._raw, self._pos)
        start = self._pos + 8
        self._pos = start + length
        return bytes(self._raw[start:self._pos]).decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop: the vocabulary and merges are ~100k of them."""
        raw, pos, unpack = self._raw, self._pos, _U64.unpack_from
        values = []
        for _ in range(count):
            (length,) = unpack(raw, pos)
            pos += 8
            values.append(str(raw[pos:pos + length], "utf-8", "replace"))
            pos += length
        self._pos = pos
        return values

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type in _NUMPY:   # numeric arrays in one read
                dtype = np.dtype(_NUMPY[item_type])
                values = np.frombuffer(self._raw, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            if item_type == _STRING:
                return self._strings(count)
            return [self._value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        return self._unpack(_SCALARS[vtype])[0]
