"""The control-plane build says what it is doing: component n of m, then modules downloaded
and packages compiled out of the total, at least every PROGRESS_SECONDS (no rebuild here)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from e2e.localcluster import binaries

pytestmark = pytest.mark.unit

LOG = """$ go mod download -json k8s.io/kubernetes@v1.33.13  (in /c)
go: downloading k8s.io/api v0.33.13
go: downloading github.com/spf13/cobra v1.8.1
# kubeinfer: packages to compile: 1200
$ go build -v -mod=mod -p 2 -o /out/ k8s.io/kubernetes/cmd/kube-apiserver  (in /w)
internal/goarch
net/http
vendor/golang.org/x/net/http2/hpack
github.com/spf13/pflag
k8s.io/apimachinery/pkg/util/sets
"""


def test_progress_counts_downloads_then_compiled_packages_of_the_total() -> None:
    assert binaries.read_progress(LOG.split("# kubeinfer")[0]).describe() == "downloading modules (2 so far)"
    progress = binaries.read_progress(LOG)
    assert (progress.downloaded, progress.compiled, progress.total) == (2, 2, 1200)
    assert progress.describe() == "compiled 2 of 1200 packages (last: k8s.io/apimachinery/pkg/util/sets)"


class Lines:
    """A stderr that other threads write to and the test can wait on."""

    def __init__(self) -> None:
        self.text, self.changed = "", threading.Condition()

    def write(self, text: str) -> None:
        with self.changed:
            self.text += text
            self.changed.notify_all()

    def flush(self) -> None:
        pass

    def wait_for(self, needle: str, count: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.text.count(needle) >= count, timeout=30)


def test_a_build_reports_its_step_and_progress_while_it_runs(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    err = Lines()

    def fake_build(version: str, out: Path, work: Path, log) -> None:
        log.write(LOG)
        log.flush()
        assert err.wait_for("compiled 2 of 1200", 2), err.text  # reported twice while still building
        (out / "fake").write_text("binary")

    monkeypatch.setitem(binaries.BUILDERS, "fake", fake_build)
    monkeypatch.setitem(binaries.COMMANDS, "fake", ("fake",))
    monkeypatch.setattr(binaries, "PROGRESS_SECONDS", 0.01)
    monkeypatch.setattr(sys, "stderr", err)
    stamp = tmp_path / "bin" / ".built"
    binaries._build("fake", "v1", tmp_path / "bin", tmp_path / "work", stamp, step="3/4")
    lines = err.text.splitlines()
    assert lines[0] == f"building [3/4] fake v1 (log: {tmp_path / 'work'}.log)"
    assert all(line.startswith("[3/4] fake v1: ") for line in lines[1:])
    assert any(line.startswith("[3/4] fake v1: compiled 2 of 1200 packages (last: k8s.io/apimachinery/pkg/util/"
                               "sets), ") for line in lines[1:])
    assert stamp.exists()
