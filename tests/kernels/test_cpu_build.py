"""Building the C kernels: cached per source, stale builds of older sources removed."""

import shutil
from pathlib import Path

import pytest

from kubeinfer.kernels import cpu_build


def test_build_is_cached_and_replaces_older_builds(tmp_path, monkeypatch):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("CI machines have a C compiler: the CPU kernels must be built and tested")
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", str(tmp_path))
    stale = tmp_path / "kernels" / "fused_cpu-0000000000000000.so"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older build")
    other = tmp_path / "kernels" / "paged_decode_cpu-0000000000000000.so"
    other.write_bytes(b"another kernel's build")
    source = Path(cpu_build.__file__).with_name("fused_cpu.c")
    target = cpu_build._build(source, compiler)
    assert target.exists() and target.parent == tmp_path / "kernels"
    assert not stale.exists() and other.exists()
    modified = target.stat().st_mtime_ns
    assert cpu_build._build(source, compiler) == target and target.stat().st_mtime_ns == modified
