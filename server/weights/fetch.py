"""`kubeinfer fetch`: bring a model source into the local cache and say where it is (JSON).

The same code runs inside `kubeinfer serve --model hf://... | s3://...`, so a laptop, an init
container and a node's cache agent fill the cache the same way. Standard output is one JSON
object (`path`, `revision`, `bytes_downloaded`, `seconds`, ...) for whoever records it; a
failure prints one line naming what was not found and exits with a code from `exit_codes`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import exit_codes
from ..flags import parse_bytes
from . import errors, hub, s3
from .cache import Filled, HeldModel, ModelCache, hold
from .uri import InvalidModelSource, ModelSource, parse_model_source

logger = logging.getLogger("kubeinfer.fetch")
TERMINATION_MESSAGE_BYTES = 4096   # what the kubelet keeps of a termination message


@dataclass(frozen=True)
class FetchedModel:
    source: str
    path: Path
    revision: str
    size: int               # bytes of the snapshot on disk
    bytes_downloaded: int   # by this call (0: it was cached, or another process fetched it)
    seconds: float
    lock_wait_seconds: float = 0.0   # waiting for another process's download of the same revision
    download_seconds: float = 0.0
    evicted: tuple[str, ...] = ()   # sources removed from the cache to make room (a node's labels name them)

    def as_json(self, limit: int | None = None) -> str:
        """One JSON object; with `limit`, the evicted list is cut so it fits in `limit` bytes."""
        report = {"source": self.source, "path": str(self.path), "revision": self.revision,
                  "size": self.size, "bytes_downloaded": self.bytes_downloaded, "seconds": round(self.seconds, 3),
                  "lock_wait_seconds": round(self.lock_wait_seconds, 3),
                  "download_seconds": round(self.download_seconds, 3), "evicted": list(self.evicted)}
        text = json.dumps(report)
        while limit is not None and len(text.encode()) > limit and report["evicted"]:
            report["evicted"].pop()
            text = json.dumps(report)
        return text


def fetch_model(text: str, cache_dir: Path | str | None = None, budget_bytes: int | None = None) -> FetchedModel:
    """Resolve `text` (hf:// or s3://) to one revision and make sure the cache holds it, downloading
    once under the cache's lock. Raises InvalidModelSource or a `errors.ModelSourceError`."""
    start = time.perf_counter()
    source = parse_model_source(text)
    cache = ModelCache(Path(cache_dir) if cache_dir else None)
    if source.scheme == "hf":
        repo = hub.repo_cache_name(source.location)
        revision, files = hub.resolve(source, cache)
        if files is None:
            filled = Filled(cache.snapshot(repo, revision), 0, 0.0, 0.0)
        else:
            wanted = hub.files_to_fetch(files)
            if not any(f.name.endswith(hub.WEIGHT_SUFFIXES) for f in wanted):
                raise errors.NotFound(f"no weights (.safetensors or .gguf) in {source} at commit {revision}; "
                                      f"it has {', '.join(sorted(f.name for f in files)[:8]) or 'no files'}")
            needed = sum(f.size or 0 for f in wanted)
            filled = cache.fill(repo, revision, lambda partial: hub.download(source, revision, wanted, partial),
                                needed, budget_bytes, source=f"hf://{source.location}@{revision}")
    elif source.scheme == "s3":
        repo = s3.repo_cache_name(source)
        client = s3.client()
        revision, objects = s3.resolve(source, client)
        objects = hub.files_to_fetch(objects)
        filled = cache.fill(repo, revision, lambda partial: s3.download(source, objects, partial, client),
                            sum(o.size for o in objects), budget_bytes, source=text)
        cache.write_ref(repo, "latest", revision)
    else:
        raise InvalidModelSource(f"model source {text!r}: only hf:// and s3:// sources are fetched "
                                 "(a local path or pvc:// claim is read where it is)")
    path = filled.path
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    fetched = FetchedModel(str(source), path, revision, size, filled.bytes_downloaded, time.perf_counter() - start,
                           filled.lock_wait_seconds, filled.download_seconds,
                           tuple(m.source for m in filled.evicted if m.source))
    logger.info("%s at %s: %s (%d bytes, %d downloaded in %.2fs after %.2fs waiting for the cache's lock; "
                "%.2fs in all)", source, revision, path, size, filled.bytes_downloaded, filled.download_seconds,
                filled.lock_wait_seconds, fetched.seconds)
    return fetched


@dataclass
class PreparedModel:
    """What `kubeinfer serve` loads: a local path, the name clients use, and the cache hold."""

    path: str
    served_name: str | None
    held: HeldModel | None


def prepare_model(text: str, cache_dir: Path | str | None = None) -> PreparedModel:
    """A remote source fetched into the cache (and held there while the server runs); a local
    directory held as it is, so a cache agent never evicts what this process serves."""
    source = parse_model_source(text)
    if not source.remote:
        local = Path(text).expanduser()
        return PreparedModel(text, None, hold(local) if source.scheme == "local" and local.is_dir() else None)
    for _ in range(3):   # an eviction may remove it between the fetch and the hold: fetch again
        fetched = fetch_model(text, cache_dir)
        held = hold(fetched.path)
        if held is not None:
            return PreparedModel(str(fetched.path), source.display_name, held)
    raise errors.CacheFull(f"{source} was evicted from the cache three times before it could be loaded")


def use_local_copy(args: argparse.Namespace, cache_dir: Path | str | None = None) -> int:
    """For `serve` and `generate`: fetch `args.model` if it is remote and point `args.model` at the
    local copy (`args.model_source` keeps what was asked; the served name defaults to the repo id;
    `args.model_hold` keeps the model marked in use). Returns 0, or the exit code once the reason
    is logged and written where Kubernetes shows it."""
    args.model_source = args.model
    try:
        prepared = prepare_model(args.model, cache_dir)
    except (InvalidModelSource, errors.ModelSourceError) as exc:
        message = str(exc) if isinstance(exc, InvalidModelSource) else f"{exc.reason}: {exc}"
        logger.error("%s", message)
        exit_codes.write_termination_message(message)
        return 2 if isinstance(exc, InvalidModelSource) else exc.exit_code
    args.model, args.model_hold = prepared.path, prepared.held
    if getattr(args, "served_model_name", None) is None:
        args.served_model_name = prepared.served_name
    return 0


def report_failure(message: str) -> None:
    """One line on stderr and, in a container, the termination message the operator shows."""
    print(f"kubeinfer fetch: {message}", file=sys.stderr)
    exit_codes.write_termination_message(message)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="hf://org/name[@revision] or s3://bucket/prefix.")
    parser.add_argument("--cache-dir", default=None,
                        help="Model cache directory (default: $KUBEINFER_CACHE/models, ~/.cache/kubeinfer/models).")
    parser.add_argument("--cache-budget", type=parse_bytes, default=None,
                        help="Keep the cache within this size (bytes or a quantity such as 40Gi), evicting least "
                             "recently used models that no process holds.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx2", "httpx", "botocore", "boto3"):   # a line per request or per config lookup
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        fetched = fetch_model(args.model, args.cache_dir, args.cache_budget)
    except InvalidModelSource as exc:
        report_failure(str(exc))
        return 2
    except errors.ModelSourceError as exc:
        report_failure(f"{exc.reason}: {exc}")
        return exc.exit_code
    print(fetched.as_json(), flush=True)
    # the operator reads the bytes, the lock wait and the evictions from the init container's status
    exit_codes.write_termination_message(fetched.as_json(limit=TERMINATION_MESSAGE_BYTES))
    return 0
