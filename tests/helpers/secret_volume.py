"""A Secret volume as the kubelet writes it, for tests of key rotation, and a clock they move."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

_versions = itertools.count()


def publish(volume: Path, files: dict[str, str | bytes]) -> None:
    """Write `files` as the kubelet's atomic writer does: a new timestamped directory, the
    `..data` symlink renamed onto it in one step, and each file a symlink through `..data`."""
    volume.mkdir(parents=True, exist_ok=True)
    version = volume / f"..2026_11_29_{next(_versions):06d}"
    for name, content in files.items():
        path = version / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else None
    (volume / "..data_tmp").symlink_to(version.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    for top in {name.split("/")[0] for name in files}:
        if not (volume / top).is_symlink():
            (volume / top).symlink_to(f"..data/{top}")
    if old is not None:
        for path in sorted((volume / old).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (volume / old).rmdir()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
