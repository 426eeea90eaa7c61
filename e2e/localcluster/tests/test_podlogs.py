"""Container logs in the CRI format kwok's `kubectl logs` reads, with `current`/`previous` runs."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from e2e.localcluster.podlogs import ContainerLog, cri_line

pytestmark = pytest.mark.integration

CRI = re.compile(rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z (stdout|stderr) F (.*)$")


def test_cri_line_is_timestamp_stream_tag_and_one_line() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, 600007, tzinfo=timezone.utc)
    assert cri_line("stderr", b"boom\n", when) == b"2026-01-02T03:04:05.600007Z stderr F boom\n"
    assert cri_line("stdout", b"no newline", when).endswith(b" stdout F no newline\n")


def run(log: ContainerLog, number: int, script: str) -> None:
    log.begin(number, f"--- run {number}")
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log.pump(proc.stdout, proc.stderr)
    proc.wait()
    log.end()


def test_runs_rotate_current_to_previous_and_keep_streams_apart(tmp_path: Path) -> None:
    log = ContainerLog(tmp_path / "engine.log", tmp_path / "cri" / "engine")
    run(log, 0, "echo out-0; echo err-0 >&2; printf partial")
    log.begin(1, "--- run 1")
    assert log.previous.resolve() == tmp_path / "cri" / "engine" / "0.log"  # from its exit on
    run(log, 1, "echo out-1")
    log.begin(2, "--- run 2")
    assert log.current.read_bytes() == b""
    current = [CRI.match(line).groups() for line in (tmp_path / "cri" / "engine" / "1.log").read_bytes().splitlines()]
    previous = sorted(CRI.match(line).groups() for line in (tmp_path / "cri" / "engine" / "0.log").read_bytes()
                      .splitlines())
    assert current == [(b"stdout", b"out-1")]
    assert previous == [(b"stderr", b"err-0"), (b"stdout", b"out-0"), (b"stdout", b"partial")]
    assert log.previous.resolve() == tmp_path / "cri" / "engine" / "1.log"
    plain = (tmp_path / "engine.log").read_text().splitlines()
    assert plain[0] == "--- run 0" and plain[-3:] == ["--- run 1", "out-1", "--- run 2"]
    assert sorted(plain[1:4]) == ["err-0", "out-0", "partial"]
