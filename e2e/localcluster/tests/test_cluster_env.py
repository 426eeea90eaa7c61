"""`eval "$(make -s env)"`: the lines give a shell this cluster's kubeconfig, its settings and
kubeinfer and helm on PATH, quoted for the shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.localcluster.binaries import binary
from e2e.localcluster.cluster import env_lines
from e2e.localcluster.config import TEST_CLUSTER_ENV, ClusterConfig

pytestmark = pytest.mark.integration


def test_env_lines_set_kubeconfig_path_and_the_chosen_cluster(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    for name in TEST_CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KUBEINFER_CLUSTER_DIR", str(tmp_path / "my cluster"))
    monkeypatch.setenv("KUBEINFER_CLUSTER_PORT_BASE", "61900")
    script = "\n".join(env_lines(ClusterConfig())) + '\necho "$KUBECONFIG|$KUBEINFER_CLUSTER_PORT_BASE|$PATH"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}).stdout.strip()
    kubeconfig, port_base, path = out.split("|")
    assert kubeconfig == str(tmp_path / "my cluster" / "pki" / "admin.kubeconfig") and port_base == "61900"
    assert path.split(os.pathsep)[:2] == [str(Path(sys.executable).parent), str(binary("helm").parent)]
    assert path.endswith(":/usr/bin:/bin")
