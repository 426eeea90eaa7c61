"""Model stores that tests and e2e fetch from: real server processes on loopback.

- `HubServer`: enough of the Hugging Face Hub's HTTP API for huggingface_hub (`model_info` with
  a revision and file metadata, `list_repo_tree`, `hf_hub_download`, `snapshot_download`, the
  `hf` CLI): repositories made of local folders, with a commit history so a branch head can
  move, LFS-style sha256 and git blob ids, ETag / X-Repo-Commit / X-Linked-Size headers, and the
  404s (`X-Error-Code`) that huggingface_hub turns into RepositoryNotFoundError and
  RevisionNotFoundError. A repository can require a token (HF_TOKEN).
- `S3Server`: moto's S3 (Apache-2.0) as a standalone server. moto needs botocore, whose
  python-dateutil<3 pin the project's kubernetes client cannot share, so it runs from its own
  venv that e2e/localcluster/binaries.py builds (`ensure("moto")`); clients use the `minio` SDK.

Both count requests per file (`counts()`), so a test can assert each file was downloaded
once, and can be told to cut or stall a file mid-transfer (`fault()`).

The state of a hub lives on disk under its root (`<root>/<org>/<name>/commits/<sha>/...`,
`refs/heads/<branch>`, `refs/tags/<tag>`): commits made while it runs are served at once.
Run as a script (`python e2e/model_stores.py hub|s3 ...`) it is the server process itself.
tests/ and e2e/ import this module; the product never does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit
from urllib.request import Request, urlopen

LFS_THRESHOLD = 1024   # files at least this big are "LFS" files (the hub's own threshold is 10 MB)
_CHUNK = 1 << 20


# ---------------------------------------------------------------- repositories on disk

def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _file_entry(path: Path, name: str) -> dict[str, Any]:
    """What the hub says of one file: size, git blob id, and the LFS pointer's sha256 if LFS."""
    size = path.stat().st_size
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            sha256.update(chunk)
            sha1.update(chunk)
    entry: dict[str, Any] = {"path": name, "size": size, "blob_id": sha1.hexdigest()}
    if size >= LFS_THRESHOLD:
        entry["lfs"] = {"sha256": sha256.hexdigest(), "size": size, "pointer_size": 134}
    return entry


class HubRepos:
    """Repositories under `root`, with commits, branches and tags (what the server serves)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id

    def commit(self, repo_id: str, folder: Path, branch: str = "main", message: str = "update") -> str:
        """Commit `folder`'s files as the new head of `branch` (creating the repo); returns the sha.
        Files are hard-linked when the filesystem allows, so a multi-GB checkpoint costs no copy."""
        repo = self.repo_dir(repo_id)
        parent = self.resolve(repo_id, branch) or ""
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        manifest = [_file_entry(p, p.relative_to(folder).as_posix()) for p in files]
        sha = hashlib.sha1(json.dumps([parent, message, time.time_ns(), manifest]).encode()).hexdigest()
        staging = repo / "commits" / f".{sha}"
        for p, entry in zip(files, manifest):
            target = staging / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, target)
            except OSError:
                shutil.copy2(p, target)
        (staging / ".manifest.json").write_text(json.dumps({"parent": parent, "message": message,
                                                            "files": manifest}))
        os.replace(staging, repo / "commits" / sha)
        self._write_ref(repo_id, "heads", branch, sha)
        return sha

    def tag(self, repo_id: str, tag: str, sha: str) -> None:
        self._write_ref(repo_id, "tags", tag, sha)

    def require_token(self, repo_id: str, token: str) -> None:
        """Make the repository private: readable only with `Authorization: Bearer <token>`."""
        (self.repo_dir(repo_id) / "token").write_text(token)

    def _write_ref(self, repo_id: str, kind: str, name: str, sha: str) -> None:
        ref = self.repo_dir(repo_id) / "refs" / kind / name
        ref.parent.mkdir(parents=True, exist_ok=True)
        temp = ref.with_name(f".{ref.name}.tmp")
        temp.write_text(sha)
        os.replace(temp, ref)

    def exists(self, repo_id: str) -> bool:
        return (self.repo_dir(repo_id) / "commits").is_dir()

    def resolve(self, repo_id: str, revision: str) -> str | None:
        """A branch, tag or full sha (or a unique sha prefix of 7+) to a commit sha."""
        repo = self.repo_dir(repo_id)
        for kind in ("heads", "tags"):
            ref = repo / "refs" / kind / revision
            if ref.is_file():
                return ref.read_text().strip()
        commits = repo / "commits"
        if len(revision) >= 7 and commits.is_dir():
            matches = [c.name for c in commits.iterdir() if c.name.startswith(revision) and not c.name.startswith(".")]
            if len(matches) == 1:
                return matches[0]
        return None

    def manifest(self, repo_id: str, sha: str) -> list[dict[str, Any]]:
        return json.loads((self.repo_dir(repo_id) / "commits" / sha / ".manifest.json").read_text())["files"]

    def file_path(self, repo_id: str, sha: str, name: str) -> Path:
        return self.repo_dir(repo_id) / "commits" / sha / name


# ---------------------------------------------------------------- the hub server process

class _HubState:
    def __init__(self, repos: HubRepos) -> None:
        self.repos = repos
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.faults: dict[str, dict[str, Any]] = {}   # "<repo>/<file>" -> {"after": bytes, "mode": cut|stall}

    def count(self, key: str, method: str) -> None:
        with self.lock:
            self.counts[key][method] += 1


class _HubHandler(BaseHTTPRequestHandler):
    server_version = "kubeinfer-test-hub"
    protocol_version = "HTTP/1.1"
    state: _HubState

    def log_message(self, format: str, *args: Any) -> None:   # quiet: counts() is the log tests read
        return

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def do_POST(self) -> None:
        if urlsplit(self.path).path == "/_faults":
            fault = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with self.state.lock:
                if fault.get("mode"):
                    self.state.faults[fault["file"]] = fault
                else:
                    self.state.faults.pop(fault["file"], None)
            return self._json(200, {})
        self._error(404, "EntryNotFound", "no such endpoint")

    # routing -------------------------------------------------------------------------------
    def _route(self, body: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        if url.path == "/_counts":
            with self.state.lock:
                return self._json(200, {k: dict(v) for k, v in self.state.counts.items()})
        if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
            return self._api(parts[2:], query, body)
        for split in (2, 1):   # /{org}/{name}/resolve/{rev}/{path}, or a namespace-less repo
            if len(parts) > split + 2 and parts[split] == "resolve":
                return self._resolve("/".join(parts[:split]), parts[split + 1], "/".join(parts[split + 2:]), body)
        self._error(404, "EntryNotFound", "no such endpoint")

    def _api(self, parts: list[str], query: dict[str, list[str]], body: bool) -> None:
        # /api/models/{repo}[/revision/{rev}] and /api/models/{repo}/tree/{rev}[/{path}]
        for split in (2, 1):
            repo_id, rest = "/".join(parts[:split]), parts[split:]
            if rest[:1] in ([], ["revision"], ["tree"]) and (rest or len(parts) == split):
                break
        else:
            return self._error(404, "RepoNotFound", "Repository not found")
        sha = self._commit_of(repo_id, rest[1] if len(rest) > 1 else "main")
        if sha is None:
            return
        files = self.state.repos.manifest(repo_id, sha)
        if rest[:1] == ["tree"]:
            return self._json(200, _tree(files, "/".join(rest[2:]), "recursive" in query and
                                         query["recursive"][0].lower() in ("1", "true")), body)
        siblings = [{"rfilename": f["path"], "size": f["size"], "blobId": f["blob_id"],
                     **({"lfs": {"sha256": f["lfs"]["sha256"], "size": f["lfs"]["size"],
                                 "pointerSize": f["lfs"]["pointer_size"]}} if "lfs" in f else {})}
                    for f in files]
        self._json(200, {"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                         "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
                         "lastModified": "2026-01-01T00:00:00.000Z", "siblings": siblings}, body)

    def _commit_of(self, repo_id: str, revision: str) -> str | None:
        repos = self.state.repos
        if not repos.exists(repo_id):
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        token_file = repos.repo_dir(repo_id) / "token"
        if token_file.is_file() and self.headers.get("Authorization") != f"Bearer {token_file.read_text()}":
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        sha = repos.resolve(repo_id, revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha

    def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        sha = self._commit_of(repo_id, revision)
        if sha is None:
            return
        entry = next((f for f in self.state.repos.manifest(repo_id, sha) if f["path"] == name), None)
        if entry is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist at {sha}")
        key = f"{repo_id}/{name}"
        self.state.count(key, self.command)
        etag = entry["lfs"]["sha256"] if "lfs" in entry else entry["blob_id"]
        size = entry["size"]
        start, end = 0, size
        ranged = self.headers.get("Range", "")
        if body and ranged.startswith("bytes="):
            first, _, last = ranged[6:].partition("-")
            start, end = int(first or 0), (int(last) + 1 if last else size)
        self.send_response(206 if (body and ranged and start > 0) else 200)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{etag}"')
        if "lfs" in entry:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if start > 0:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            self._send_file(self.state.repos.file_path(repo_id, sha, name), start, end, key)

    def _fault(self, key: str) -> dict[str, Any] | None:
        with self.state.lock:
            return self.state.faults.get(key)

    def _send_file(self, path: Path, start: int, end: int, key: str) -> None:
        sent = start
        with open(path, "rb") as f:
            f.seek(start)
            while sent < end:
                limit = end - sent
                fault = self._fault(key)
                if fault is not None:
                    limit = min(limit, max(fault["after"] - sent, 0))
                    if limit == 0:
                        if fault["mode"] == "stall":   # hold the connection open, sending nothing
                            time.sleep(0.05)
                            continue
                        if fault["mode"] == "corrupt":   # the right size, the wrong bytes
                            data = bytearray(f.read(end - sent))
                            if data:
                                data[0] ^= 0xFF
                            self.wfile.write(bytes(data))
                            return
                        self.close_connection = True   # "cut": the connection drops mid-file
                        self.wfile.flush()
                        self.connection.shutdown(2)
                        return
                chunk = f.read(min(_CHUNK, limit))
                if not chunk:
                    return
                self.wfile.write(chunk)
                sent += len(chunk)

    def _json(self, status: int, payload: Any, body: bool = True) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _tree(files: list[dict[str, Any]], under: str, recursive: bool) -> list[dict[str, Any]]:
    """The hub's tree listing of `under`: files (with LFS info) and folders, one level or all."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    entries: dict[str, dict[str, Any]] = {}
    for f in files:
        if not f["path"].startswith(prefix):
            continue
        rest = f["path"][len(prefix):].split("/")
        for depth in range(1, len(rest)):
            folder = prefix + "/".join(rest[:depth])
            if recursive or depth == 1:
                entries.setdefault(folder, {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                            "path": folder})
        if recursive or len(rest) == 1:
            entry = {"type": "file", "oid": f["blob_id"], "size": f["size"], "path": f["path"]}
            if "lfs" in f:
                entry["lfs"] = {"oid": f["lfs"]["sha256"], "size": f["lfs"]["size"],
                                "pointerSize": f["lfs"]["pointer_size"]}
            entries[f["path"]] = entry
    return list(entries.values())


# ---------------------------------------------------------------- the S3 server process

def _s3_app() -> Any:
    """moto's S3 as a WSGI app, wrapped to count GETs per object and to cut a GET on request."""
    from moto.server import DomainDispatcherApplication, create_backend_app

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    faults: dict[str, dict[str, Any]] = {}

    def counted(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path == "/_counts":
            with lock:
                data = json.dumps({k: dict(v) for k, v in counts.items()}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
            return iter([data])
        if path == "/_faults" and method == "POST":
            fault = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
            with lock:
                if fault.get("mode"):
                    faults[fault["file"]] = fault
                else:
                    faults.pop(fault["file"], None)
            start_response("200 OK", [("Content-Length", "2")])
            return iter([b"{}"])
        key = unquote(path.lstrip("/"))
        if "/" in key and method in ("GET", "HEAD"):   # /<bucket>/<key>: an object, not a listing
            with lock:
                counts[key][method] += 1
                fault = faults.get(key) if method == "GET" else None
            if fault is not None:
                return _cut(app(environ, start_response), fault["after"])
        return app(environ, start_response)

    return counted


def _cut(body: Iterator[bytes], after: int) -> Iterator[bytes]:
    """The first `after` bytes of a body, then a dropped connection."""
    sent = 0
    for chunk in body:
        if sent + len(chunk) >= after:
            yield chunk[: after - sent]
            raise ConnectionAbortedError("fault injected: connection cut mid-object")
        sent += len(chunk)
        yield chunk


# ---------------------------------------------------------------- handles the tests use

class _ServerProcess:
    """A store running as a child process; `url` once it listens."""

    kind = ""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, extra: list[str] | None = None) -> None:
        self.host, self.port = host, port
        self._args = [self.python(), str(Path(__file__).resolve()), self.kind, "--host", host,
                      "--port", str(port), *(extra or [])]
        self.process: subprocess.Popen | None = None

    def python(self) -> str:
        return sys.executable

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "_ServerProcess":
        self.process = subprocess.Popen(self._args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()   # the child prints its port once it listens
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"{self.kind} server did not start: {line}{self.process.stderr.read()}")
        self.port = int(line)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "_ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def counts(self) -> dict[str, dict[str, int]]:
        """Requests per file so far: {"<repo or bucket>/<file>": {"GET": n, "HEAD": m}}."""
        with urlopen(f"{self.url}/_counts", timeout=10) as response:
            return json.loads(response.read())

    def gets(self, file: str) -> int:
        return self.counts().get(file, {}).get("GET", 0)

    def fault(self, file: str, mode: str | None, after: int = 0) -> None:
        """From now on, a GET of `file` ("<repo or bucket>/<path>") is cut ("cut") after `after`
        bytes, held open without sending ("stall"; hub only), or sent with a flipped byte
        ("corrupt"; hub only); mode None clears it."""
        body = json.dumps({"file": file, "mode": mode, "after": after}).encode()
        with urlopen(Request(f"{self.url}/_faults", data=body, method="POST"), timeout=10):
            pass


class HubServer(_ServerProcess):
    """A Hugging Face Hub-compatible endpoint (point HF_ENDPOINT at `url`) serving `repos`."""

    kind = "hub"

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.repos = HubRepos(root)
        super().__init__(host, port, ["--root", str(root)])

    def env(self, token: str | None = None) -> dict[str, str]:
        """Environment for a client of this hub (huggingface_hub, `hf`, `kubeinfer`)."""
        env = {"HF_ENDPOINT": self.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "30"}
        if token:
            env["HF_TOKEN"] = token
        return env


class S3Server(_ServerProcess):
    """moto's S3 on loopback; `env()` gives a client its endpoint and (any) credentials."""

    kind = "s3"
    ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"

    def python(self) -> str:
        from e2e.localcluster import binaries

        return str(binaries.ensure("moto") / "venv" / "bin" / "python")

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_REGION": self.REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self) -> Any:
        from minio import Minio

        return Minio(f"{self.host}:{self.port}", access_key=self.ACCESS_KEY, secret_key=self.SECRET_KEY,
                     secure=False, region=self.REGION)

    def upload_folder(self, bucket: str, prefix: str, folder: Path) -> list[str]:
        """Create `bucket` if needed and put `folder`'s files under `prefix`; returns the keys."""
        client = self.client()
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
        keys = []
        for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            key = f"{prefix.strip('/')}/{path.relative_to(folder).as_posix()}".lstrip("/")
            client.fput_object(bucket, key, str(path))
            keys.append(key)
        return keys


# ---------------------------------------------------------------- entry point of the child

def _serve_hub(args: argparse.Namespace) -> None:
    handler = type("Handler", (_HubHandler,), {"state": _HubState(HubRepos(Path(args.root)))})
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


def _serve_s3(args: argparse.Namespace) -> None:
    from werkzeug.serving import make_server

    server = make_server(args.host, args.port, _s3_app(), threaded=True)
    print(server.server_port, flush=True)
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["hub", "s3"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", help="hub: the folder of repositories (HubRepos)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    (_serve_hub if args.kind == "hub" else _serve_s3)(args)


if __name__ == "__main__":
    main()
