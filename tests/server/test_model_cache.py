"""The model cache's own rules: one filler per revision, least recently used eviction that never
removes a model a process holds, and a budget that refuses what cannot fit."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kubeinfer.server.weights import errors
from kubeinfer.server.weights.cache import CachedModel, Filled, ModelCache, hold, write_checked

pytestmark = pytest.mark.unit


def paths(models: list[CachedModel]) -> list[Path]:
    return [model.path for model in models]


def add_snapshot(cache: ModelCache, repo: str, revision: str, size: int, used_at: float,
                 source: str | None = None) -> Path:
    def download(partial: Path) -> int:
        return write_checked(partial, "model.safetensors", [os.urandom(size)], lambda written: None)

    path = cache.fill(repo, revision, download, source=source).path
    os.utime(path, (used_at, used_at))
    return path


def test_eviction_removes_least_recently_used_but_never_a_held_model(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path)
    now = time.time()
    oldest = add_snapshot(cache, "models--a--x", "1" * 40, 1000, now - 300)
    held_path = add_snapshot(cache, "models--a--y", "2" * 40, 1000, now - 200)
    newest = add_snapshot(cache, "models--a--z", "3" * 40, 1000, now - 100)
    held = hold(held_path)
    assert held is not None
    os.utime(held_path, (now - 200, now - 200))   # hold() touched it; make it the LRU candidate again

    assert paths(cache.evict(budget_bytes=1000)) == [oldest, newest]   # the held one is skipped
    newest = add_snapshot(cache, "models--a--z", "3" * 40, 1000, now - 100)
    oldest = add_snapshot(cache, "models--a--x", "1" * 40, 1000, now - 300)
    cache.write_ref("models--a--x", "main", "1" * 40)
    assert paths(cache.evict(budget_bytes=2000)) == [oldest]   # enough: the newest stays
    assert not oldest.exists() and held_path.is_dir() and newest.is_dir()
    assert cache.read_ref("models--a--x", "main") is None   # no ref to a removed snapshot
    assert cache.evict(budget_bytes=1000, min_idle_seconds=3600) == []   # all recently used

    held.release()
    assert paths(cache.evict(budget_bytes=1000)) == [held_path]
    assert [m.path for m in cache.models()] == [newest]


def test_fill_downloads_once_while_others_wait(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path)
    calls, started = [], threading.Event()

    def slow_download(partial: Path) -> int:
        calls.append(partial)
        started.set()
        time.sleep(0.3)
        return write_checked(partial, "w.safetensors", [b"x" * 10], lambda written: None)

    results: list[Filled] = []
    threads = [threading.Thread(target=lambda: results.append(cache.fill("models--o--m", "a" * 40, slow_download)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert sorted(filled.bytes_downloaded for filled in results) == [0, 0, 0, 10]
    assert len({filled.path for filled in results}) == 1
    downloader = next(filled for filled in results if filled.bytes_downloaded)
    assert downloader.download_seconds >= 0.3
    # the three others spent the download waiting for the lock, and said so
    assert all(filled.lock_wait_seconds >= 0.2 and filled.download_seconds == 0
               for filled in results if filled is not downloader)


def test_a_failed_check_leaves_no_file_and_no_snapshot(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path)

    def corrupt(written: int) -> None:
        raise errors.DataCorrupt("checksum mismatch")

    with pytest.raises(errors.DataCorrupt):
        cache.fill("models--o--m", "b" * 40,
                   lambda partial: write_checked(partial, "w.safetensors", [b"x" * 10], corrupt))
    assert cache.snapshot("models--o--m", "b" * 40) is None
    assert not list(tmp_path.rglob("w.safetensors*"))


def test_budget_evicts_to_make_room_or_refuses(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path)
    old = add_snapshot(cache, "models--a--x", "1" * 40, 1000, time.time() - 100, source=f"hf://a/x@{'1' * 40}")
    write = lambda partial: write_checked(partial, "w.safetensors", [b"x" * 1500], lambda written: None)  # noqa: E731
    filled = cache.fill("models--a--new", "2" * 40, write, needed_bytes=1500, budget_bytes=2000)
    path = filled.path
    assert not old.exists() and path.is_dir()
    # the eviction names the source it removed (the operator unlabels the node with it)
    assert [m.source for m in filled.evicted] == [f"hf://a/x@{'1' * 40}"]
    assert not (tmp_path / "models--a--x" / ".sources" / ("1" * 40)).exists()
    held = hold(path)
    with pytest.raises(errors.CacheFull, match="models in use hold 1500 bytes"):
        cache.fill("models--a--other", "3" * 40, write, needed_bytes=1500, budget_bytes=2000)
    held.release()
