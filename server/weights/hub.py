"""`hf://org/name[@revision]`: a Hugging Face Hub repository, or a mirror of it (`HF_ENDPOINT`).

huggingface_hub resolves the revision (its `model_info`, which also lists each file's size, git
blob id and LFS sha256) and makes the HTTP requests, with `HF_ENDPOINT`, `HF_TOKEN` and its
retries; the files go into the kubeinfer cache (`cache.py`), each checked against the hub's
checksum as it streams: LFS files by sha256, small files by their git blob sha1.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, TypeVar

from . import errors
from .cache import ModelCache, write_checked
from .uri import ModelSource, is_commit_sha

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".gguf")
# other serializations of the same weights, skipped when safetensors are there (as vLLM does)
_OTHER_FORMATS = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".ot", ".gguf")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None     # LFS files
    git_blob: str | None   # the git blob sha1 (small files)


class _Named(Protocol):
    name: str


T = TypeVar("T", bound=_Named)


def repo_cache_name(repo_id: str) -> str:
    """Hugging Face's cache folder name for a model repository."""
    return "models--" + repo_id.replace("/", "--")


def files_to_fetch(files: list[T]) -> list[T]:
    """What the engine loads: safetensors (or else GGUF) weights and every non-weight file, leaving
    out other serializations of the same weights and Meta's `original/` consolidated checkpoints."""
    names = [f.name for f in files]
    if any(name.endswith(".safetensors") for name in names):
        return [f for f in files if not f.name.endswith(_OTHER_FORMATS) and not f.name.startswith("original/")]
    return [f for f in files if not f.name.endswith(_OTHER_FORMATS[:-1])]


@contextmanager
def _hub_errors(source: ModelSource, revision: str) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into ours, with what was not found in the message."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    import httpx2

    endpoint = constants.ENDPOINT
    try:
        yield
    except GatedRepoError as error:
        raise errors.AccessDenied(f"model repository {source.location!r} on {endpoint} is gated: set "
                                  "HF_TOKEN to a token that was granted access") from error
    except RepositoryNotFoundError as error:
        raise errors.NotFound(f"model repository {source.location!r} not found on {endpoint} (if it is "
                              "private, set HF_TOKEN to a token that can read it)") from error
    except RevisionNotFoundError as error:
        raise errors.NotFound(f"revision {revision!r} not found in model repository {source.location!r} "
                              f"on {endpoint}") from error
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            raise errors.AccessDenied(f"{endpoint} refused access to {source.location!r} ({status}): "
                                      "check HF_TOKEN") from error
        raise errors.Unreachable(f"{endpoint} failed for {source}: {error}") from error
    except (OfflineModeIsEnabled, httpx2.TransportError) as error:
        raise errors.Unreachable(f"cannot reach {endpoint} for {source} ({error})") from error


def resolve(source: ModelSource, cache: ModelCache) -> tuple[str, list[RemoteFile] | None]:
    """(commit sha, files at it); files is None when the commit is cached (no network needed)."""
    from huggingface_hub import HfApi, constants

    repo = repo_cache_name(source.location)
    revision = source.revision or "main"
    if is_commit_sha(revision) and cache.snapshot(repo, revision):
        return revision, None
    if constants.HF_HUB_OFFLINE:
        sha = cache.read_ref(repo, revision)
        if sha and cache.snapshot(repo, sha):
            return sha, None
        raise errors.Unreachable(f"HF_HUB_OFFLINE is set and {source} (revision {revision!r}) is not in the "
                                 f"cache at {cache.root}")
    try:
        with _hub_errors(source, revision):
            info = HfApi().model_info(source.location, revision=revision, files_metadata=True)
    except errors.Unreachable:
        sha = cache.read_ref(repo, revision)
        if sha and cache.snapshot(repo, sha):   # the hub is down: serve what `revision` last was
            logger.warning("%s unreachable: serving %s at %s, the commit it resolved to last time",
                           constants.ENDPOINT, source, sha)
            return sha, None
        raise
    files = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in info.siblings or ()]
    if revision != info.sha:
        cache.write_ref(repo, revision, info.sha)
    return info.sha, files


def download(source: ModelSource, commit: str, files: list[RemoteFile], partial: Path) -> int:
    """Fetch `files` at `commit` into `partial`, each checked; files a killed attempt finished stay."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"   # sizes and checksums are of the bytes as stored
    total = 0
    for remote in files:
        if (partial / remote.name).is_file():
            continue
        url = hf_hub_url(source.location, remote.name, revision=commit)
        with _hub_errors(source, commit), http_stream_backoff("GET", url, headers=headers, follow_redirects=True,
                                                              retry_on_status_codes=(429, 500, 502, 503, 504)) as response:
            hf_raise_for_status(response)
            check = _Checksum(remote, str(source))
            total += write_checked(partial, remote.name, check.feed(response.iter_bytes()), check.verify)
    return total


class _Checksum:
    """Hashes a file as it streams by and compares it with what the hub says it is."""

    def __init__(self, remote: RemoteFile, source: str) -> None:
        self.remote, self.source = remote, source
        self.digest = hashlib.sha256() if remote.sha256 else hashlib.sha1() if remote.git_blob else None
        self.header_pending = remote.sha256 is None and remote.git_blob is not None

    def feed(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        if self.header_pending and self.remote.size is not None:   # git hashes "blob <size>\0" first
            self.digest.update(b"blob %d\0" % self.remote.size)
            self.header_pending = False
        for chunk in chunks:
            if self.digest is not None:
                self.digest.update(chunk)
            yield chunk

    def verify(self, size: int) -> None:
        remote = self.remote
        if remote.size is not None and size != remote.size:
            raise errors.DataCorrupt(f"{self.source}: {remote.name} is {size} bytes, the hub lists {remote.size}")
        expected = remote.sha256 or remote.git_blob
        if self.digest is not None and not self.header_pending and self.digest.hexdigest() != expected:
            raise errors.DataCorrupt(f"{self.source}: {remote.name} does not match the hub's checksum "
                                     f"({self.digest.hexdigest()} != {expected})")
