"""`kubeinfer fetch` against real hub- and S3-compatible server processes (e2e/model_stores.py):
each file downloaded once, checked, written then renamed, and clear failures with their exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.model_stores import HubServer, S3Server
from kubeinfer.server import exit_codes

pytestmark = pytest.mark.integration

FILES = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}',
         "model.safetensors": os.urandom(300_000),
         "pytorch_model.bin": os.urandom(2_000),     # another serialization: not fetched
         "tokenizer.json": b"{}"}


def write_model(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def fetch(model: str, cache: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubeinfer.server.cli", "fetch", "--model", model,
                           "--cache-dir", str(cache), *extra], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def start_fetch(model: str, cache: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", "fetch", "--model", model,
                             "--cache-dir", str(cache)], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fetched(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def snapshots(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/snapshots/*"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hub")
    with HubServer(root / "repos") as server:
        server.commit_sha = server.repos.commit("org/tiny", write_model(root / "v1", FILES))
        yield server


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    with S3Server() as server:
        server.upload_folder("models", "tiny", write_model(tmp_path_factory.mktemp("s3") / "v1", FILES))
        yield server


def test_fetch_prints_json_and_downloads_each_file_once(hub: HubServer, tmp_path: Path) -> None:
    before = hub.counts()
    first = fetched(fetch("hf://org/tiny", tmp_path, hub.env()))
    assert first["revision"] == hub.commit_sha and first["source"] == "hf://org/tiny"
    path = Path(first["path"])
    assert path == tmp_path / "models--org--tiny" / "snapshots" / hub.commit_sha
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert first["bytes_downloaded"] == first["size"] == 300_000 + len(FILES["config.json"]) + 2
    again = fetched(fetch("hf://org/tiny@main", tmp_path, hub.env()))
    assert again["path"] == first["path"] and again["bytes_downloaded"] == 0
    after = hub.counts()
    assert all(after[f"org/tiny/{name}"].get("GET", 0) - before.get(f"org/tiny/{name}", {}).get("GET", 0) == 1
               for name in ("config.json", "model.safetensors", "tokenizer.json"))
    assert "org/tiny/pytorch_model.bin" not in after


def test_fetch_reports_its_wait_download_and_evictions_as_the_termination_message(
        hub: HubServer, s3: S3Server, tmp_path: Path) -> None:
    """What the operator reads from the init container's status: bytes, lock wait, download time,
    and the sources a budget evicted (whose node labels go)."""
    cache, message = tmp_path / "cache", tmp_path / "termination-log"
    message.touch()
    env = {**hub.env(), exit_codes.TERMINATION_LOG_ENV: str(message)}
    first = fetched(fetch("hf://org/tiny", cache, env))
    assert json.loads(message.read_text()) == first
    assert first["bytes_downloaded"] > 0 and first["lock_wait_seconds"] >= 0 and first["evicted"] == []
    assert 0 < first["download_seconds"] <= first["seconds"]
    budget = str(first["size"] + first["size"] // 2)   # room for one of the two models
    second = fetched(fetch("s3://models/tiny", cache, {**s3.env(), exit_codes.TERMINATION_LOG_ENV: str(message)},
                           "--cache-budget", budget))
    assert json.loads(message.read_text()) == second
    assert second["evicted"] == [f"hf://org/tiny@{hub.commit_sha}"] and len(snapshots(cache)) == 1


def test_pinned_commit_in_the_cache_needs_no_hub(tmp_path: Path) -> None:
    with HubServer(tmp_path / "repos") as server:
        sha = server.repos.commit("org/tiny", write_model(tmp_path / "v1", FILES))
        fetched(fetch(f"hf://org/tiny@{sha}", tmp_path / "cache", server.env()))
        env = server.env()
    result = fetched(fetch(f"hf://org/tiny@{sha}", tmp_path / "cache", env))   # the hub is gone now
    assert result["revision"] == sha and result["bytes_downloaded"] == 0


def test_concurrent_fetches_download_each_file_once(hub: HubServer, s3: S3Server, tmp_path: Path) -> None:
    before_hub, before_s3 = hub.counts(), s3.counts()
    runs = [start_fetch(model, tmp_path, env) for model, env in
            [("hf://org/tiny", hub.env())] * 3 + [("s3://models/tiny", s3.env())] * 3]
    results = [(run.wait(timeout=120), *run.communicate()) for run in runs]
    assert all(code == 0 for code, _, _ in results), results
    paths = {json.loads(out)["path"] for _, out, _ in results}
    assert len(paths) == 2   # one snapshot per source, shared
    for store, before, key in ((hub, before_hub, "org/tiny"), (s3, before_s3, "models/tiny")):
        after = store.counts()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            gets = after[f"{key}/{name}"]["GET"] - before.get(f"{key}/{name}", {}).get("GET", 0)
            assert gets == 1, (key, name, gets)


def test_download_killed_mid_file_leaves_nothing_served(tmp_path: Path) -> None:
    with HubServer(tmp_path / "repos") as server:
        sha = server.repos.commit("org/tiny", write_model(tmp_path / "v1", FILES))
        server.fault("org/tiny/model.safetensors", "stall", after=100_000)
        cache = tmp_path / "cache"
        run = start_fetch("hf://org/tiny", cache, server.env())
        incomplete = cache / "models--org--tiny" / ".partial" / sha / "model.safetensors.incomplete"
        deadline = time.monotonic() + 60
        while not (incomplete.is_file() and incomplete.stat().st_size >= 100_000):
            if run.poll() is not None or time.monotonic() > deadline:
                run.kill()
                pytest.fail(f"the fetch did not stall mid-file: {run.communicate()}")
            time.sleep(0.05)
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert snapshots(cache) == []   # nothing a server would load
        server.fault("org/tiny/model.safetensors", None)
        result = fetched(fetch("hf://org/tiny", cache, server.env()))
        path = Path(result["path"])
        assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
        assert not list(path.rglob("*.incomplete"))
        counts = server.counts()
        # the file cut short is fetched again; the ones the killed run finished are kept
        assert counts["org/tiny/model.safetensors"]["GET"] == 2
        assert counts["org/tiny/config.json"]["GET"] == 1


@pytest.mark.parametrize("mode, code", [("cut", None), ("corrupt", exit_codes.MODEL_DATA_CORRUPT)])
def test_broken_transfers_are_refused(mode: str, code: int | None, tmp_path: Path) -> None:
    with HubServer(tmp_path / "repos") as server:
        server.repos.commit("org/tiny", write_model(tmp_path / "v1", FILES))
        server.fault("org/tiny/model.safetensors", mode, after=50_000)
        result = fetch("hf://org/tiny", tmp_path / "cache", server.env())
    assert result.returncode != 0 and ("model.safetensors" in result.stderr or "Unreachable" in result.stderr)
    if code is not None:
        assert result.returncode == code and "does not match the hub's checksum" in result.stderr
    assert snapshots(tmp_path / "cache") == []


def test_s3_cut_mid_object_leaves_nothing_served(s3: S3Server, tmp_path: Path) -> None:
    s3.upload_folder("cutbucket", "m", write_model(tmp_path / "v1", FILES))
    s3.fault("cutbucket/m/model.safetensors", "cut", after=100_000)
    try:
        result = fetch("s3://cutbucket/m", tmp_path / "cache", s3.env())
    finally:
        s3.fault("cutbucket/m/model.safetensors", None)
    assert result.returncode != 0
    assert snapshots(tmp_path / "cache") == []
    assert fetched(fetch("s3://cutbucket/m", tmp_path / "cache", s3.env()))["size"] > 300_000


@pytest.mark.parametrize("model, code, message", [
    ("hf://org/missing", exit_codes.MODEL_NOT_FOUND, "model repository 'org/missing' not found"),
    ("hf://org/tiny@no-such-branch", exit_codes.MODEL_NOT_FOUND,
     "revision 'no-such-branch' not found in model repository 'org/tiny'"),
    ("hf://org/weightless", exit_codes.MODEL_NOT_FOUND, "no weights (.safetensors or .gguf) in hf://org/weightless"),
    ("hf://org/private", exit_codes.MODEL_NOT_FOUND, "set HF_TOKEN"),
    ("hf://org/bad repo", 2, "expected hf://org/name[@revision]"),
])
def test_hub_failures_name_what_is_missing(hub: HubServer, tmp_path: Path, model: str, code: int,
                                           message: str) -> None:
    hub.repos.commit("org/weightless", write_model(tmp_path / "readme-only", {"README.md": b"hi"}))
    hub.repos.commit("org/private", write_model(tmp_path / "private", FILES))
    hub.repos.require_token("org/private", "secret-token")
    result = fetch(model, tmp_path / "cache", hub.env())
    assert result.returncode == code and message in result.stderr, result.stderr
    assert result.stdout == "" and snapshots(tmp_path / "cache") == []


def test_private_repo_with_hf_token(hub: HubServer, tmp_path: Path) -> None:
    hub.repos.commit("org/secret", write_model(tmp_path / "v1", FILES))
    hub.repos.require_token("org/secret", "the-token")
    assert fetched(fetch("hf://org/secret", tmp_path / "cache", hub.env(token="the-token")))["size"] > 0


@pytest.mark.parametrize("model, env_change, code, message", [
    ("s3://nosuchbucket/x", {}, exit_codes.MODEL_NOT_FOUND, "bucket 'nosuchbucket' not found"),
    ("s3://models/empty", {}, exit_codes.MODEL_NOT_FOUND, "no objects under s3://models/empty"),
    ("s3://models/docs", {}, exit_codes.MODEL_NOT_FOUND, "no weights (.safetensors or .gguf) under s3://models/docs"),
    ("s3://models/tiny", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                          "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"},
     exit_codes.MODEL_ACCESS_DENIED, "no usable AWS credentials for s3://models/tiny"),
])
def test_s3_failures_name_what_is_missing(s3: S3Server, tmp_path: Path, model: str, env_change: dict,
                                          code: int, message: str) -> None:
    s3.upload_folder("models", "docs", write_model(tmp_path / "docs", {"README.md": b"hi"}))
    result = fetch(model, tmp_path / "cache", {**s3.env(), **env_change})
    assert result.returncode == code and message in result.stderr, result.stderr
    assert snapshots(tmp_path / "cache") == []


def test_cache_budget_too_small_is_cache_full(hub: HubServer, tmp_path: Path) -> None:
    result = fetch("hf://org/tiny", tmp_path / "cache", hub.env(), "--cache-budget", "100Ki")
    assert result.returncode == exit_codes.MODEL_CACHE_FULL
    assert "more than the cache budget of 102400 bytes" in result.stderr
