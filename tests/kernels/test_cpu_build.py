"""Building the C kernels: cached per source, stale builds of older sources removed."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubeinfer.kernels.cpu import cpu_build

pytestmark = pytest.mark.integration


def test_build_is_cached_and_forgets_only_builds_unused_for_a_week(tmp_path, monkeypatch):
    """Another source's build used recently belongs to a server of another version sharing this
    cache: deleting it between that server's build and its load sent it to the torch ops."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("CI machines have a C compiler: the CPU kernels must be built and tested")
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "kernels"
    folder.mkdir()
    unused = folder / "fused_cpu-0000000000000000.so"
    unused.write_bytes(b"an older source's build, unused for eight days")
    eight_days_ago = time.time() - 8 * 24 * 3600
    os.utime(unused, (eight_days_ago, eight_days_ago))
    in_use = folder / "fused_cpu-1111111111111111.so"
    in_use.write_bytes(b"another version's build, loaded an hour ago")
    os.utime(in_use, (time.time() - 3600, time.time() - 3600))
    other = folder / "paged_decode_cpu-0000000000000000.so"
    other.write_bytes(b"another kernel's build")
    os.utime(other, (eight_days_ago, eight_days_ago))
    source = Path(cpu_build.__file__).with_name("fused_cpu.c")
    target = cpu_build._build(source, compiler)
    assert target.exists() and target.parent == folder
    assert not unused.exists() and in_use.exists() and other.exists()
    built = target.stat().st_ino
    os.utime(target, (eight_days_ago, eight_days_ago))
    assert cpu_build._build(source, compiler) == target and target.stat().st_ino == built  # not rebuilt
    assert time.time() - target.stat().st_mtime < 3600   # marked as used again


def test_start_building_compiles_every_kernel_without_loading_or_importing_torch(tmp_path):
    """`kubeinfer serve` calls it before `import torch`: it must not load a kernel (that would link
    an OpenMP runtime ahead of torch's) nor pull torch in, and it must leave every build cached."""
    script = ("import sys\n"
              "from kubeinfer.kernels.cpu import cpu_build\n"
              "cpu_build.start_building()\n"
              "for build in cpu_build._BACKGROUND.values(): build.result()\n"
              "assert 'torch' not in sys.modules\n"
              "maps = open('/proc/self/maps').read()\n"
              "assert '/kernels/' not in maps and 'gomp' not in maps, 'a kernel was loaded'\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300,
                   env={**os.environ, "KUBEINFER_CACHE_DIR": str(tmp_path)})
    built = sorted(path.name.rpartition("-")[0] for path in (tmp_path / "kernels").glob("*.so"))
    assert built == sorted(cpu_build.KERNELS)


def test_background_builds_run_one_at_a_time_in_order_and_report_when_done(monkeypatch):
    """`start_building` compiles the kernels it is given one after the other (a second core stays
    free for the server's own start), never starts one twice, and `building` is true exactly
    until each build has finished."""
    import threading

    release = threading.Event()
    started: list[str] = []
    running = threading.Semaphore(1)

    def fake_compiled(name):
        assert running.acquire(blocking=False), "two builds ran at once"
        started.append(name)
        release.wait(60)
        running.release()
        return None

    monkeypatch.setattr(cpu_build, "compiled", fake_compiled)
    monkeypatch.setattr(cpu_build, "_BACKGROUND", {})
    cpu_build.start_building(cpu_build.LOADING_KERNELS)
    assert [cpu_build.building(name) for name in cpu_build.KERNELS] == [True, True, False, False, False, False]
    cpu_build.start_building()   # the rest: only the attention, LoRA and int8 kernels are new
    assert all(cpu_build.building(name) for name in cpu_build.KERNELS)
    release.set()
    for future in list(cpu_build._BACKGROUND.values()):
        assert future.result(timeout=60) is None
    assert not any(cpu_build.building(name) for name in cpu_build.KERNELS)
    assert not cpu_build.building("never_started")
    assert started == list(cpu_build.KERNELS)
