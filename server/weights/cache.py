"""The local model cache: each model fetched once, verified, and never seen half-written.

Layout (Hugging Face's cache layout, so its tools can read a Hub model from here too):

    <root>/models--<org>--<name>/        one per repository (`s3--<bucket>--<prefix>` for a bucket)
        refs/<branch or tag>             the commit it last resolved to (offline fallback)
        snapshots/<revision>/<files>     complete, verified copies, one per revision (real files)
        .partial/<revision>/             being downloaded; renamed into snapshots/ when complete
        .locks/<revision>.lock           held exclusively by the one process downloading
        .sources/<revision>              the source it was fetched as (`hf://org/name@<commit>`),
                                         so an eviction can say which model went

Every process that wants a revision takes its lock; the first downloads, the others wait and
find the snapshot there when they get the lock, so concurrent pods on a node download once.
A file is written as `<name>.incomplete`, checked and renamed; the directory is renamed into
`snapshots/` only when every file passed, so a killed download leaves only `.partial/` (whose
checked files the next attempt keeps).

A process that serves a snapshot holds a shared flock on its directory (`hold`); eviction
takes an exclusive, non-blocking one and skips what it cannot get, so it never removes a model
in use.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from . import errors

MODELS_DIR = "models"


def default_cache_root() -> Path:
    """`$KUBEINFER_CACHE/models` (default `~/.cache/kubeinfer/models`)."""
    base = os.environ.get("KUBEINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kubeinfer")
    return Path(base) / MODELS_DIR


def directory_size(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file() and not entry.is_symlink())


@dataclass(frozen=True)
class CachedModel:
    """One complete snapshot in the cache."""

    path: Path
    size: int
    last_used: float   # the snapshot directory's mtime, touched at every use
    source: str | None = None   # what it was fetched as (None: filled before sources were recorded)


@dataclass(frozen=True)
class Filled:
    """What `ModelCache.fill` did: where the snapshot is and where this call's time went."""

    path: Path
    bytes_downloaded: int        # 0: it was cached, or another process fetched it while this one waited
    lock_wait_seconds: float     # blocked on the revision's lock (another process was downloading it)
    download_seconds: float      # this call's own download, checks included
    evicted: tuple[CachedModel, ...] = ()   # removed to make room for it


class HeldModel:
    """A shared flock on a model directory, kept while the process serves it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)   # closing the descriptor drops the flock
            self._fd = -1


def hold(path: Path) -> HeldModel | None:
    """Mark `path` (a model directory) in use until the returned handle is released or the process
    exits; None if it was evicted meanwhile (the caller fetches again). Works on read-only mounts."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)   # waits only while an eviction of this very directory runs
    try:
        still_there = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        still_there = False
    if not still_there:   # the eviction we waited for moved it away
        os.close(fd)
        return None
    try:
        os.utime(path)   # least recently used is what eviction removes first
    except OSError:
        pass   # a read-only mount: whoever filled it keeps the clock
    return HeldModel(path, fd)


@contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class ModelCache:
    """The cache under one root directory (a node's hostPath, a shared volume or ~/.cache)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_root()

    def repo_dir(self, name: str) -> Path:
        return self.root / name

    def snapshot(self, repo: str, revision: str) -> Path | None:
        """The complete snapshot of `revision`, if the cache has it."""
        path = self.repo_dir(repo) / "snapshots" / revision
        return path if path.is_dir() else None

    def read_ref(self, repo: str, ref: str) -> str | None:
        try:
            return (self.repo_dir(repo) / "refs" / ref).read_text().strip() or None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_ref(self, repo: str, ref: str, revision: str) -> None:
        self._write_atomically(self.repo_dir(repo) / "refs" / ref, revision)

    @staticmethod
    def _write_atomically(target: Path, text: str) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temp.write_text(text)
        os.replace(temp, target)

    def fill(self, repo: str, revision: str, download: Callable[[Path], int],
             needed_bytes: int = 0, budget_bytes: int | None = None, source: str | None = None) -> Filled:
        """The snapshot of `revision`, downloading it first if no process has: `download(partial_dir)`
        writes (and checks) every file into `partial_dir`, keeping files a killed attempt completed,
        and returns the bytes it transferred. `source` is recorded beside the snapshot (what an
        eviction reports). With `budget_bytes`, least recently used snapshots not in use are evicted
        to make room; raises CacheFull when the model cannot fit (budget or free disk space)."""
        repo_dir = self.repo_dir(repo)
        final = repo_dir / "snapshots" / revision
        if final.is_dir():
            return Filled(final, 0, 0.0, 0.0)
        waiting = time.perf_counter()
        with _exclusive(repo_dir / ".locks" / f"{revision}.lock"):
            waited = time.perf_counter() - waiting
            if final.is_dir():   # another process finished it while we waited
                return Filled(final, 0, waited, 0.0)
            partial = repo_dir / ".partial" / revision
            partial.mkdir(parents=True, exist_ok=True)
            evicted = self._make_room(needed_bytes - directory_size(partial), budget_bytes)
            downloading = time.perf_counter()
            downloaded = download(partial)
            seconds = time.perf_counter() - downloading
            if source is not None:
                self._write_atomically(repo_dir / ".sources" / revision, source)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, final)
            _fsync_dir(final.parent)
            return Filled(final, downloaded, waited, seconds, tuple(evicted))

    def _make_room(self, needed_bytes: int, budget_bytes: int | None) -> list[CachedModel]:
        """Evict within the budget for `needed_bytes` more; what was evicted."""
        evicted: list[CachedModel] = []
        if needed_bytes <= 0:
            return evicted
        if budget_bytes is not None:
            if needed_bytes > budget_bytes:
                raise errors.CacheFull(f"the model needs {needed_bytes} bytes, more than the cache budget "
                                       f"of {budget_bytes} bytes ({self.root})")
            evicted = self.evict(budget_bytes - needed_bytes)
            held = self.used_bytes()
            if held + needed_bytes > budget_bytes:
                raise errors.CacheFull(f"the model needs {needed_bytes} bytes; the cache budget is {budget_bytes} "
                                       f"bytes and models in use hold {held} bytes ({self.root})")
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < needed_bytes:
            raise errors.CacheFull(f"the model needs {needed_bytes} bytes but the cache volume has {free} bytes "
                                   f"free ({self.root})")
        return evicted

    def models(self) -> list[CachedModel]:
        """Every complete snapshot, least recently used first."""
        found = []
        for snapshots in self.root.glob("*/snapshots"):
            for path in snapshots.iterdir():
                if path.is_dir():
                    found.append(CachedModel(path, directory_size(path), path.stat().st_mtime,
                                             self._source_of(path)))
        return sorted(found, key=lambda model: model.last_used)

    @staticmethod
    def _source_of(snapshot: Path) -> str | None:
        try:
            return (snapshot.parent.parent / ".sources" / snapshot.name).read_text().strip() or None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def used_bytes(self) -> int:
        return sum(model.size for model in self.models())

    def evict(self, budget_bytes: int, min_idle_seconds: float = 0.0) -> list[CachedModel]:
        """Remove least recently used snapshots until the cache holds at most `budget_bytes`,
        skipping any a process holds (`hold`) and any used in the last `min_idle_seconds` (a
        fetch that exits before its server starts leaves that gap). Returns what was removed."""
        models = self.models()
        total = sum(model.size for model in models)
        removed: list[CachedModel] = []
        now = time.time()
        for model in models:
            if total <= budget_bytes:
                break
            if now - model.last_used < min_idle_seconds:
                continue
            if self._remove_unless_held(model.path):
                removed.append(model)
                total -= model.size
        return removed

    def _remove_unless_held(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False   # a server holds it
            # renamed first, so no reader ever opens a half-deleted snapshot
            trash = path.parent.parent / ".trash" / f"{path.name}.{os.getpid()}.{time.monotonic_ns()}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, trash)
            self._drop_refs_to(path.parent.parent, path.name)
            (path.parent.parent / ".sources" / path.name).unlink(missing_ok=True)
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    @staticmethod
    def _drop_refs_to(repo_dir: Path, revision: str) -> None:
        refs = repo_dir / "refs"
        for ref in refs.rglob("*") if refs.is_dir() else ():
            if ref.is_file() and ref.read_text().strip() == revision:
                ref.unlink(missing_ok=True)


def write_checked(partial: Path, name: str, chunks: Iterable[bytes], check: Callable[[int], None]) -> int:
    """Stream `chunks` into `partial/name` through `<name>.incomplete`; `check(size)` (the caller
    hashes the chunks as they pass) raises if the result is wrong, and then nothing named `name`
    appears. Returns the bytes written."""
    target = partial / name
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(target.name + ".incomplete")
    written = 0
    try:
        with open(temp, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        temp.unlink(missing_ok=True)
        raise errors.CacheFull(f"the cache volume filled up writing {target} ({error.strerror})") from error
    try:
        check(written)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    os.replace(temp, target)
    return written


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
