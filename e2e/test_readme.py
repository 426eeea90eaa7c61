"""A new user's first hour, as README.md tells it, in a clean HOME (issue 20's acceptance).

`make demo`, its last line (the environment line), then every README block marked
``<!-- readme-test -->`` run by bash exactly as written: `kubectl get kis`, `kubectl logs`, a
port-forward and a chat completion through it, `helm test --logs`, a 2-replica service answered
through its Service. Then the curl the demo printed, a `make demo` rerun, and `make test` twice
around the demo's release: once on its own cluster, once pointed at the demo's cluster (where it
must refuse), the release's revision and values unchanged.

Clean HOME: nothing of the user's environment but PATH's kubectl. Two caches a fresh machine
fills on its first run are lent to it, not rebuilt: KUBEINFER_CACHE's ``bin`` is a symlink to
the shared build (``~/.cache/kubeinfer/bin``, 13 cold minutes) and KUBEINFER_VENV is this
venv (torch's install). Its clusters get their own directories, ports and pod IPs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.localcluster.binaries import CACHE

pytestmark = pytest.mark.release
REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-test -->"
DEMO_PORTS, NESTED_PORTS = 62300, 62400  # apart from the session's and the default clusters


def readme_blocks() -> list[str]:
    """The ```bash blocks right after a readme-test marker."""
    text = (REPO / "README.md").read_text()
    return re.findall(re.escape(MARK) + r"\s*```bash\n(.*?)```", text, re.S)


def test_the_readme_marks_the_first_hour_blocks() -> None:
    blocks = readme_blocks()
    assert blocks and 'eval "$(make -s env)"' in blocks[0]


def ports_free(*ranges: range) -> bool:
    for port in (p for r in ranges for p in r):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def clean_env(home: Path, port_base: int, cidr: str) -> dict[str, str]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "the README's prerequisite kubectl is not on PATH"
    path = os.pathsep.join(dict.fromkeys([str(Path(kubectl).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
    return {"HOME": str(home), "PATH": path, "LANG": "C.UTF-8", "KUBEINFER_CACHE": str(home / ".cache" / "kubeinfer"),
            "KUBEINFER_VENV": sys.prefix, "KUBEINFER_CLUSTER_PORT_BASE": str(port_base),
            "KUBEINFER_CLUSTER_POD_CIDR": cidr}


def bash(script: str, env: dict[str, str], timeout: float = 900) -> str:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{script}\nexit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def helm_state(env: dict[str, str]) -> tuple[int, dict]:
    out = bash('eval "$(make -s env)"; helm history kubeinfer -n kubeinfer-system --max 1 -o json; '
               'helm get values kubeinfer -n kubeinfer-system --all -o json', env)
    history, values = out.splitlines()[0], "\n".join(out.splitlines()[1:])
    return json.loads(history)[-1]["revision"], json.loads(values)


@pytest.mark.timeout(2400)  # two demos, a nested cluster and its helm test: each step has its own bound
def test_first_hour_from_the_readme_in_a_clean_home(tmp_path: Path) -> None:
    if not ports_free(range(DEMO_PORTS, DEMO_PORTS + 100), range(NESTED_PORTS, NESTED_PORTS + 100),
                      range(8000, 8001)):
        pytest.skip(f"needs loopback ports 8000 and {DEMO_PORTS}-{NESTED_PORTS + 99} free on this machine")
    home = tmp_path / "home"
    (home / ".cache" / "kubeinfer").mkdir(parents=True)
    (home / ".cache" / "kubeinfer" / "bin").symlink_to(CACHE / "bin")
    env = clean_env(home, DEMO_PORTS, "127.45.0.0/16")
    try:
        start = time.monotonic()
        demo = bash("make demo", env)
        first_demo = time.monotonic() - start
        last = demo.strip().splitlines()[-1]
        assert last.startswith('eval "$(') and last.endswith('make -s env)"'), demo[-2000:]
        for block in readme_blocks():
            out = bash(block, env)
            assert re.search(r"^smollm2 +True +1/1 +embedded +SmolLM2-135M-Instruct +1 ", out, re.M), out
            assert 'HTTP/1.1" 200' in out, out  # the engine's own access log, through kubectl logs
            assert '"object":"chat.completion"' in out.replace(" ", ""), out
            assert "Phase:          Succeeded" in out and "POD LOGS: kubeinfer-test" in out, out
            assert out.count('"id":"SmolLM2-135M-Instruct"') >= 1, out
        url = re.search(r"curl -s (http://127\.0\.0\.1:\d+/v1)/chat/completions", demo).group(1)
        printed = re.search(r"(curl -s http://127\.0\.0\.1:\d+/v1/chat/completions .*?\n.*?-d '.*?')", demo, re.S)
        assert '"object":"chat.completion"' in bash(printed.group(1).replace("\\\n", " "), env).replace(" ", "")
        # Both gateway replicas: the demo waits for the first only, so the second may still be starting.
        two_endpoints = rf"default/smollm2:80 +{re.escape(url.removesuffix('/v1'))} +endpoints: \S+, \S+"
        deadline = time.monotonic() + 120
        while not re.search(two_endpoints, endpoints := bash('eval "$(make -s env)"; make -s cluster-status', env)):
            assert time.monotonic() < deadline, endpoints
            time.sleep(2)
        start = time.monotonic()
        bash("make demo", env)
        rerun = time.monotonic() - start
        print(f"\nfirst demo {first_demo:.0f} s, rerun {rerun:.0f} s")

        revision, values = helm_state(env)
        nested = dict(env, KUBEINFER_CLUSTER_DIR=str(tmp_path / "test-cluster"),
                      KUBEINFER_CLUSTER_PORT_BASE=str(NESTED_PORTS), KUBEINFER_CLUSTER_POD_CIDR="127.46.0.0/16")
        bash(f"{sys.executable} -m pytest -q -p no:cacheprovider e2e/test_operator_helm.py -k helm_test", nested)
        refused = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "e2e/test_operator_helm.py", "-k", "helm_test"], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and "refusing to run e2e tests on the cluster" in refused.stdout, \
            refused.stdout[-3000:]
        assert helm_state(env) == (revision, values)
    finally:
        subprocess.run(["make", "-s", "cluster-down"], cwd=REPO, env=env, capture_output=True, timeout=120)
