"""API keys from flags, env and `--api-keys-file`: parsed alike, refused loudly when a key file
is unusable or keys are required but absent, and never echoed in output or logs."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import httpx
import pytest
from helpers.secret_volume import publish
from helpers.serve_process import free_port, wait_until_ready

from kubeinfer.server.api.auth import OPEN_PATHS
from kubeinfer.server.credentials import CredentialFiles
from kubeinfer.server.flags import SERVER_FLAGS, add_flags, parse_api_keys

pytestmark = pytest.mark.integration

ADMIN_PATHS = ("/kv/blocks", "/tokenizer_info")   # served on --admin-port when it is set
KEY_FILE = "# team A, rotated 2026-11\nsk-alpha-0001\n\n  sk-beta-0002  \n# sk-revoked-9999\n"



def args_for(*argv: str, environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, SERVER_FLAGS, environ=environ or {})
    return parser.parse_args(list(argv))


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """The keys a `kubeinfer serve` or `route` with these flags starts with."""
    return CredentialFiles.from_args(args).current.api_keys


def test_keys_split_on_commas_and_lines_and_skip_comments() -> None:
    assert parse_api_keys(KEY_FILE) == ["sk-alpha-0001", "sk-beta-0002"]
    assert parse_api_keys("sk-a, sk-b,,\r\nsk-c") == ["sk-a", "sk-b", "sk-c"]
    assert parse_api_keys("") == parse_api_keys("# only a comment\n\n") == []


def test_key_file_adds_to_the_flag_and_env(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    args = args_for("--api-keys-file", str(path), environ={"KUBEINFER_API_KEYS": "sk-env"})
    assert api_keys_from_args(args) == ["sk-env", "sk-alpha-0001", "sk-beta-0002"]
    args = args_for(environ={"KUBEINFER_API_KEYS_FILE": str(path)})
    assert api_keys_from_args(args) == ["sk-alpha-0001", "sk-beta-0002"]


def test_unusable_key_file_stops_startup_without_echoing_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# sk-commented-out\n\n")
    with pytest.raises(SystemExit, match="holds no API key") as stopped:
        api_keys_from_args(args_for("--api-keys-file", str(empty)))
    assert "sk-commented-out" not in str(stopped.value)
    with pytest.raises(SystemExit, match="cannot read it"):
        api_keys_from_args(args_for("--api-keys-file", str(tmp_path / "missing")))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe sk-bytes")
    with pytest.raises(SystemExit, match="cannot read it") as stopped:
        api_keys_from_args(args_for("--api-keys-file", str(binary)))
    assert "sk-bytes" not in str(stopped.value)


def test_required_keys_refuse_to_start_open() -> None:
    with pytest.raises(SystemExit, match="no API key is configured"):
        api_keys_from_args(args_for(environ={"KUBEINFER_API_KEYS": " \n# none\n",
                                             "KUBEINFER_REQUIRE_API_KEY": "true"}))
    assert api_keys_from_args(args_for("--require-api-key", "--api-keys", "sk-1")) == ["sk-1"]
    assert api_keys_from_args(args_for()) == []  # no keys, not required: open, as before


def test_open_paths_are_exactly_the_engine_routes_without_the_key_check() -> None:
    """The gateway leaves OPEN_PATHS open: a new engine route must be guarded or listed."""
    from fastapi.testclient import TestClient

    from kubeinfer.server.api.app import build_app

    # No engine behind it: a route that passes the key check fails later, with a 500.
    app = build_app(SimpleNamespace(), ["sk-1"])  # type: ignore[arg-type]
    client = TestClient(app, raise_server_exceptions=False)
    refused, passed = set(), {"/openapi.json"} if client.get("/openapi.json").status_code == 200 \
        else set()
    for path, methods in app.openapi()["paths"].items():
        for method in methods:
            status = client.request(method, path.replace("{model_id}", "m"), json={}).status_code
            (refused if status == 401 else passed).add(path)
    assert passed == OPEN_PATHS
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= refused


def test_serve_with_a_key_file_guards_the_api_and_logs_no_key(tiny_model_path: str,
                                                               tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(KEY_FILE)
    port, admin_port = free_port(), free_port()
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", tiny_model_path,
         "--port", str(port), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8Mi",
         "--max-model-len", "128", "--api-keys-file", str(keys), "--log-level", "debug",
         "--admin-port", str(admin_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(process, url, timeout=180)
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        body = {"prompt": "hi", "max_tokens": 2}
        missing = httpx.post(url + "/v1/completions", json=body)
        wrong = httpx.post(url + "/v1/completions", json=body,
                           headers={"Authorization": "Bearer sk-revoked-9999"})
        ok = [httpx.post(url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {key}"})
              for key in ("sk-alpha-0001", "sk-beta-0002")]
        open_paths = {path: httpx.get((admin if path in ADMIN_PATHS else url) + path).status_code
                      for path in sorted(OPEN_PATHS)}
        guarded = {path: httpx.get(url + path).status_code for path in ("/v1/models",)}
        not_public = {path: httpx.get(url + path, headers={"Authorization": "Bearer sk-alpha-0001"}).status_code
                      for path in ADMIN_PATHS}
    finally:
        process.terminate()
        output = process.communicate(timeout=60)[0]
    assert missing.status_code == wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert [r.status_code for r in ok] == [200, 200]
    assert open_paths == {path: 200 for path in OPEN_PATHS}
    assert guarded == {"/v1/models": 401}
    assert not_public == {path: 404 for path in ADMIN_PATHS}   # on --admin-port only
    assert "API keys required on the OpenAI routes (2 configured)" in output
    for secret in ("sk-alpha", "sk-beta", "sk-revoked"):
        assert secret not in output and secret not in cmdline


def test_serve_follows_a_rotated_key_secret_without_a_restart(tiny_model_path: str, tmp_path: Path) -> None:
    """`kubeinfer serve` with its key file and tenant table in a Secret volume the kubelet
    updates: the rotated keys open the API within --key-reload-seconds, the revoked ones get
    401, a broken version is refused while the keys in force stay, and no key reaches the log."""
    volume = tmp_path / "secret"
    tenants = "tenants:\n  - name: team-a\n    keys_file: keys/team-a\n"
    publish(volume, {"api-keys": "sk-admin-old\n", "tenants.yaml": tenants, "keys/team-a": "sk-team-a-old\n"})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kubeinfer.server.cli", "serve", "--model", tiny_model_path,
         "--port", str(port), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8Mi",
         "--max-model-len", "128", "--api-keys-file", str(volume / "api-keys"),
         "--tenants-file", str(volume / "tenants.yaml"), "--require-api-key", "--key-reload-seconds", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def status(key: str) -> int:
        return httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                          headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    def reloads(outcome: str) -> float:
        text = httpx.get(url + "/metrics").text
        line = f'kubeinfer:credential_reloads_total{{outcome="{outcome}"}}'
        return next(float(row.split()[-1]) for row in text.splitlines() if row.startswith(line))

    def eventually(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30
        while not check():
            assert time.monotonic() < deadline, "the rotation did not take effect in 30 s"
            time.sleep(0.1)

    try:
        wait_until_ready(process, url, timeout=180)
        before = {key: status(key) for key in ("sk-admin-old", "sk-team-a-old", "sk-team-a-new")}
        publish(volume, {"api-keys": "sk-admin-new\n", "tenants.yaml": tenants, "keys/team-a": "sk-team-a-new\n"})
        eventually(lambda: status("sk-team-a-new") == 200)
        after = {key: status(key) for key in ("sk-admin-old", "sk-admin-new", "sk-team-a-old", "sk-team-a-new")}
        publish(volume, {"api-keys": "# emptied by mistake\n", "tenants.yaml": tenants, "keys/team-a": "sk-x\n"})
        eventually(lambda: status("sk-admin-new") == 200 and reloads("refused") == 1)   # looked at on a request
        kept = {key: status(key) for key in ("sk-admin-new", "sk-team-a-new", "sk-x")}
        metrics = httpx.get(url + "/metrics").text
    finally:
        process.terminate()
        output = process.communicate(timeout=60)[0]
    assert before == {"sk-admin-old": 200, "sk-team-a-old": 200, "sk-team-a-new": 401}
    assert after == {"sk-admin-old": 401, "sk-admin-new": 200, "sk-team-a-old": 401, "sk-team-a-new": 200}
    assert kept == {"sk-admin-new": 200, "sk-team-a-new": 200, "sk-x": 401}
    assert 'kubeinfer:tenant_requests_total{model_name=' in metrics and 'tenant="team-a"' in metrics
    assert "--api-keys-file" in output and "holds no API key" in output   # the refusal, logged
    for secret in ("sk-admin", "sk-team-a", "sk-x"):
        assert secret not in output
