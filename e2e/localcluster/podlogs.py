"""A runner container's logs, written the way a container runtime writes them.

Why two files: kwok's kubelet API (``kubectl logs``) reads the CRI log format that the kubelet
reads (``<RFC3339Nano time> <stdout|stderr> F <line>``), one file per container run, with the
previous run kept for ``--previous``; people and the demo read the plain ``<container>.log``
that collects every run. ``current`` and ``previous`` are symlinks, so the kwok ``Logs``
object naming them never changes.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO


def cri_line(stream: str, line: bytes, when: datetime | None = None) -> bytes:
    """One line in the CRI log format (always a full line: ``F``)."""
    stamp = (when or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ").encode()
    return b"%s %s F %s\n" % (stamp, stream.encode(), line.rstrip(b"\n"))


@dataclass
class ContainerLog:
    plain: Path  # <pod dir>/<container>.log: every run, as the process wrote it
    cri_dir: Path  # <pod dir>/<container>/<run>.log in CRI format
    lock: threading.Lock = field(default_factory=threading.Lock)
    pumps: list[threading.Thread] = field(default_factory=list)
    run: int = 0

    @property
    def current(self) -> Path:
        return self.cri_dir.parent / f"{self.cri_dir.name}.current.log"

    @property
    def previous(self) -> Path:
        return self.cri_dir.parent / f"{self.cri_dir.name}.previous.log"

    def begin(self, run: int, banner: str) -> None:
        """A new run: its CRI file, empty (a runner that restarted counts runs from 0 again, and a
        run never shows another's lines, as each container ID has its own file), becomes `current`."""
        self.cri_dir.mkdir(parents=True, exist_ok=True)
        (self.cri_dir / f"{run}.log").write_bytes(b"")
        _link(self.current, self.cri_dir / f"{run}.log")
        with open(self.plain, "ab") as plain:
            plain.write(banner.encode() + b"\n")
        self.run = run

    def pump(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Copy the process's two pipes into both logs until it closes them."""
        self.pumps = [threading.Thread(target=self._copy, args=(name, pipe, self.run), daemon=True)
                      for name, pipe in (("stdout", stdout), ("stderr", stderr))]
        for thread in self.pumps:
            thread.start()

    def end(self, timeout: float = 2.0) -> None:
        """The process exited: write what it left in its pipes; its run becomes `previous`
        (as the kubelet's `--previous` is the last terminated container)."""
        for thread in self.pumps:
            thread.join(timeout)
        _link(self.previous, self.cri_dir / f"{self.run}.log")

    def _copy(self, stream: str, pipe: IO[bytes], run: int) -> None:
        with pipe, open(self.plain, "ab") as plain, open(self.cri_dir / f"{run}.log", "ab") as cri:
            for line in iter(pipe.readline, b""):
                with self.lock:
                    plain.write(line if line.endswith(b"\n") else line + b"\n")
                    plain.flush()
                    cri.write(cri_line(stream, line))
                    cri.flush()


def _link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` atomically (a reader never finds it missing)."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name if target.parent == link.parent else os.path.relpath(target, link.parent))
    os.replace(tmp, link)
