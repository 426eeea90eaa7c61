"""`HF_ENDPOINT=<mirror> kubeinfer serve --model hf://org/name@<commit>`, tried as a user would:
it serves; two servers started at once on an empty cache download each file once; restarted with
the hub gone it loads from its cache; a moved branch head leaves `@<old commit>` as it was; an
unknown repo or revision ends the process with its exit code and a message naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from e2e.model_stores import HubServer
from helpers.serve_process import free_port, wait_until_ready
from helpers.tiny_models import make_tiny_llama
from kubeinfer.server import exit_codes

pytestmark = pytest.mark.integration

PROMPT = {"prompt": "hello hello world", "max_tokens": 6, "temperature": 0}


def serve(model: str, env: dict[str, str], port: int, stack: ExitStack) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", model,
                                "--dtype", "float32", "--device", "cpu", "--port", str(port)],
                               env={**os.environ, "OMP_NUM_THREADS": "1", "KUBEINFER_LOG_LEVEL": "warning", **env},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)

    stack.callback(stop)
    return process


def complete(port: int, model: str) -> str:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={**PROMPT, "model": model}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_serve_pinned_commit_from_a_mirror_once_then_from_cache(tmp_path: Path) -> None:
    cache = tmp_path / "kubeinfer-cache"
    env = {"KUBEINFER_CACHE": str(cache)}
    with HubServer(tmp_path / "repos") as hub:
        old = hub.repos.commit("org/tiny-llama", make_tiny_llama(tmp_path / "v1", seed=0))
        env.update(hub.env())
        with ExitStack() as stack:   # two replicas starting at once on an empty cache
            ports = [free_port(), free_port()]
            servers = [serve(f"hf://org/tiny-llama@{old}", env, port, stack) for port in ports]
            for server, port in zip(servers, ports):
                wait_until_ready(server, f"http://127.0.0.1:{port}", timeout=240)
            served = [httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] for port in ports]
            assert served == ["org/tiny-llama"] * 2
            answers = {complete(port, "org/tiny-llama") for port in ports}
            assert len(answers) == 1
            answer = answers.pop()
        counts = hub.counts()
        weights = [name for name in counts if name.endswith(".safetensors")]
        assert weights and all(counts[name]["GET"] == 1 for name in counts), counts
        snapshot = cache / "models" / "models--org--tiny-llama" / "snapshots" / old
        assert (snapshot / "config.json").is_file()

        # the branch head moves to other weights: main is the new commit now, and a restart
        # pinned to the old one loads it from the cache and answers as before
        new = hub.repos.commit("org/tiny-llama", make_tiny_llama(tmp_path / "v2", seed=1))
        head = subprocess.run([sys.executable, "-m", "kubeinfer.server.cli", "fetch", "--model", "hf://org/tiny-llama"],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert json.loads(head.stdout)["revision"] == new != old
        before_restart = hub.counts()
        with ExitStack() as stack:
            port = free_port()
            server = serve(f"hf://org/tiny-llama@{old}", env, port, stack)
            wait_until_ready(server, f"http://127.0.0.1:{port}", timeout=240)
            assert complete(port, "org/tiny-llama") == answer
        assert hub.counts() == before_restart   # no request at all: the pinned commit was cached


@pytest.mark.parametrize("model, message", [
    ("hf://org/missing", "model repository 'org/missing' not found"),
    ("hf://org/tiny-llama@v404", "revision 'v404' not found in model repository 'org/tiny-llama'"),
])
def test_serve_unknown_repo_or_revision_exits_with_its_reason(tmp_path: Path, model: str, message: str) -> None:
    with HubServer(tmp_path / "repos") as hub, ExitStack() as stack:
        hub.repos.commit("org/tiny-llama", make_tiny_llama(tmp_path / "v1"))
        process = serve(model, {**hub.env(), "KUBEINFER_CACHE": str(tmp_path / "cache")}, free_port(), stack)
        output, _ = process.communicate(timeout=120)
    assert process.returncode == exit_codes.MODEL_NOT_FOUND
    assert f"ModelNotFound: {message}" in output


def test_generate_from_s3_through_the_cache(tmp_path: Path) -> None:
    """`kubeinfer generate` takes the same sources, here a prefix of the local S3 store."""
    from e2e.model_stores import S3Server

    with S3Server() as s3:
        s3.upload_folder("models", "tiny-llama", make_tiny_llama(tmp_path / "v1"))
        env = {**os.environ, **s3.env(), "KUBEINFER_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
        result = subprocess.run([sys.executable, "-m", "kubeinfer.server.cli", "generate", "--model",
                                 "s3://models/tiny-llama", "--dtype", "float32", "--device", "cpu", "--no-chat",
                                 "--max-tokens", "3", "--temperature", "0", "hello world"],
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        assert all(counts["GET"] == 1 for counts in s3.counts().values())
    assert list((tmp_path / "cache" / "models" / "s3--models--tiny-llama" / "snapshots").iterdir())
