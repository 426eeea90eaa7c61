"""The loader's safetensors reader gives what safetensors itself reads, as views of the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kubeinfer.server.model.checkpoints import safetensors_stream

pytestmark = pytest.mark.unit


def test_every_dtype_and_shape_reads_as_safetensors_reads_it_in_file_order(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {"b.bf16": torch.randn(7, 5, generator=generator).bfloat16(),
               "a.f32": torch.randn(3, 4, 2, generator=generator),
               "c.f16": torch.randn(11, generator=generator).half(),
               "d.i64": torch.arange(-4, 5, dtype=torch.int64), "e.bool": torch.tensor([True, False, True]),
               "f.u8": torch.arange(200, 255, dtype=torch.uint8), "g.scalar": torch.tensor(2.5),
               "h.empty": torch.empty(0, 3), "i.fp8": torch.randn(6, generator=generator).to(torch.float8_e4m3fn)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    read = list(safetensors_stream.tensors(path))
    with safe_open(path, framework="pt", device="cpu") as handle:
        assert [name for name, _ in read] == list(handle.offset_keys())
        for name, tensor in read:
            expected = handle.get_tensor(name)
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
            assert bytes(tensor.reshape(-1).view(torch.uint8)) == bytes(expected.reshape(-1).view(torch.uint8)), name


def test_a_view_written_to_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4)}, path)
    before = path.read_bytes()
    (_, tensor), = safetensors_stream.tensors(path)
    tensor.zero_()   # copy-on-write: a consumer that keeps and changes a view changes only its copy
    assert path.read_bytes() == before and next(safetensors_stream.tensors(path))[1].sum() == 4


def test_a_truncated_file_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(1024)}, path)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match="tensor w .*does not fit"):
        list(safetensors_stream.tensors(path))
