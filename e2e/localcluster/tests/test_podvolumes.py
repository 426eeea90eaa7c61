"""Unit tests (no cluster) for the pod runner's init containers and volumes: real local
processes, a stand-in only for the API reads (ConfigMaps, Secrets, claims)."""
from __future__ import annotations

import base64
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from kubernetes import client

from e2e.localcluster.localpod import Apiserver, LocalPod
from e2e.localcluster.podenv import ConfigError
from e2e.localcluster.podvolumes import (VolumeNotReady, container_mounts, path_rewriter, sync_volume_files,
                                         volume_dirs)

pytestmark = pytest.mark.integration

IMAGE = "kubeinfer/kubeinfer:e2e"


class Reads:
    """The API reads the runner makes for volumes, from dicts (a missing name is a 404)."""

    def __init__(self, config_maps=None, secrets=None, claims=None, volumes=None) -> None:
        self.config_maps, self.secrets = config_maps or {}, secrets or {}
        self.claims, self.volumes = claims or {}, volumes or {}

    @staticmethod
    def _get(table: dict, name: str):
        if name not in table:
            raise client.ApiException(status=404, reason="Not Found")
        return table[name]

    def read_namespaced_config_map(self, name, namespace):
        return SimpleNamespace(data=self._get(self.config_maps, name), binary_data=None)

    def read_namespaced_secret(self, name, namespace):
        return SimpleNamespace(data={k: base64.b64encode(v.encode()).decode()
                                     for k, v in self._get(self.secrets, name).items()})

    def read_namespaced_persistent_volume_claim(self, name, namespace):
        volume = self._get(self.claims, name)
        return SimpleNamespace(status=SimpleNamespace(phase="Bound" if volume else "Pending"),
                               spec=SimpleNamespace(volume_name=volume))

    def read_persistent_volume(self, name):
        return SimpleNamespace(metadata=SimpleNamespace(name=name), spec=SimpleNamespace(
            host_path=SimpleNamespace(path=self.volumes[name]), local=None))


def pod(name: str, volumes: list[dict], containers: list[dict], init: list[dict] | None = None,
        node: str = "node-a", restart: str = "Always") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {"nodeName": node, "restartPolicy": restart, "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 2, "volumes": volumes, "containers": containers,
                     "initContainers": init or []},
            "status": {"podIP": "127.0.0.1"}}


def sh(name: str, script: str, mounts: list[dict] | None = None, **extra) -> dict:
    return {"name": name, "image": IMAGE, "command": ["sh", "-c", script], "volumeMounts": mounts or [], **extra}


def test_rewriter_maps_whole_mount_paths_only() -> None:
    rewrite = path_rewriter({"/models": Path("/h/m"), "/models/cache": Path("/h/c"), "/tmp": Path("/h/t")})
    assert rewrite("/models/org/x") == "/h/m/org/x"
    assert rewrite("--model=/models/cache/a") == "--model=/h/c/a"
    assert rewrite("HOME=/tmp") == "HOME=/h/t"
    assert rewrite("cat /tmp/x; ls '/models'") == "cat /h/t/x; ls '/h/m'"
    assert rewrite("/tmpfs /data/tmp /modelsx") == "/tmpfs /data/tmp /modelsx"


def test_host_path_is_per_node_and_empty_dir_per_pod(tmp_path: Path) -> None:
    volumes = [{"name": "cache", "hostPath": {"path": "/var/cache/models", "type": "DirectoryOrCreate"}},
               {"name": "scratch", "emptyDir": {}}]
    a1 = volume_dirs(Reads(), pod("a1", volumes, []), tmp_path / "a1", tmp_path / "nodes")
    a2 = volume_dirs(Reads(), pod("a2", volumes, []), tmp_path / "a2", tmp_path / "nodes")
    b1 = volume_dirs(Reads(), pod("b1", volumes, [], node="node-b"), tmp_path / "b1", tmp_path / "nodes")
    assert a1["cache"] == a2["cache"] == tmp_path / "nodes/node-a/var/cache/models"
    assert b1["cache"] == tmp_path / "nodes/node-b/var/cache/models"
    assert a1["scratch"] != a2["scratch"] and a1["scratch"].is_dir()


def test_config_map_and_secret_become_files(tmp_path: Path) -> None:
    reads = Reads(config_maps={"settings": {"a.yaml": "x: 1", "b": "2"}}, secrets={"creds": {"key": "s3cret"}})
    volumes = [{"name": "cfg", "configMap": {"name": "settings", "items": [{"key": "a.yaml", "path": "conf/a"}]}},
               {"name": "sec", "secret": {"secretName": "creds", "defaultMode": 0o400}}]
    dirs = volume_dirs(reads, pod("p", volumes, []), tmp_path / "p", tmp_path / "nodes")
    assert (dirs["cfg"] / "conf/a").read_text() == "x: 1" and not (dirs["cfg"] / "b").exists()
    assert (dirs["sec"] / "key").read_text() == "s3cret"
    assert (dirs["sec"] / "key").stat().st_mode & 0o777 == 0o400
    with pytest.raises(VolumeNotReady, match='configMap "other" not found'):
        volume_dirs(reads, pod("q", [{"name": "c", "configMap": {"name": "other"}}], []), tmp_path / "q", tmp_path)


def test_projected_volume_holds_its_secrets_and_the_pods_annotations(tmp_path: Path) -> None:
    reads = Reads(secrets={"keys": {"team-a": "sk-1", "other": "x"}})
    volumes = [{"name": "t", "projected": {"sources": [
        {"downwardAPI": {"items": [{"path": "table.json", "fieldRef": {
            "fieldPath": "metadata.annotations['example.io/table']"}}]}},
        {"secret": {"name": "keys", "items": [{"key": "team-a", "path": "keys/keys/team-a"}]}}]}},
        {"name": "d", "downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}}]
    spec = pod("p", volumes, [])
    spec["metadata"]["annotations"] = {"example.io/table": '{"tenants": []}'}
    dirs = volume_dirs(reads, spec, tmp_path / "p", tmp_path / "nodes")
    assert (dirs["t"] / "table.json").read_text() == '{"tenants": []}'
    assert (dirs["t"] / "keys/keys/team-a").read_text() == "sk-1" and not (dirs["t"] / "keys/keys/other").exists()
    assert (dirs["d"] / "name").read_text() == "p"
    api_access = [{"name": "kube-api-access", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token"}}, {"configMap": {"name": "kube-root-ca.crt"}}]}}]
    api_dirs = volume_dirs(reads, pod("s", api_access, []), tmp_path / "s", tmp_path)
    assert not any(api_dirs["kube-api-access"].iterdir())
    missing = [{"name": "t", "projected": {"sources": [{"secret": {"name": "gone"}}]}}]
    with pytest.raises(VolumeNotReady, match='secret "gone" not found'):
        volume_dirs(reads, pod("q", missing, []), tmp_path / "q", tmp_path)


def test_a_running_pods_secret_volumes_follow_their_sources(tmp_path: Path) -> None:
    """As the kubelet syncs them: a changed key's file is replaced in one step (a reader holding
    the old file keeps it whole), a key gone from the Secret is removed, an unreadable source
    leaves the files as they were, and files of unchanged keys are not rewritten."""
    reads = Reads(secrets={"keys": {"team-a": "sk-a-1", "team-b": "sk-b-1"}})
    volumes = [{"name": "t", "projected": {"sources": [{"secret": {"name": "keys"}}]}},
               {"name": "s", "secret": {"secretName": "keys", "items": [{"key": "team-b", "path": "b"}]}}]
    spec = pod("p", volumes, [])
    dirs = volume_dirs(reads, spec, tmp_path / "p", tmp_path / "nodes")
    unchanged = (dirs["t"] / "team-a").stat().st_ino
    held = (dirs["s"] / "b").open()
    reads.secrets["keys"] = {"team-a": "sk-a-1", "team-b": "sk-b-2"}
    sync_volume_files(reads, spec, tmp_path / "p")
    assert (dirs["t"] / "team-b").read_text() == (dirs["s"] / "b").read_text() == "sk-b-2"
    assert held.read() == "sk-b-1"
    held.close()
    assert (dirs["t"] / "team-a").stat().st_ino == unchanged
    reads.secrets["keys"] = {"team-b": "sk-b-2"}
    sync_volume_files(reads, spec, tmp_path / "p")
    assert not (dirs["t"] / "team-a").exists() and (dirs["t"] / "team-b").read_text() == "sk-b-2"
    del reads.secrets["keys"]
    sync_volume_files(reads, spec, tmp_path / "p")
    assert (dirs["t"] / "team-b").read_text() == "sk-b-2"
    assert sorted(path.name for path in (tmp_path / "p" / "volumes").iterdir()) == ["s", "t"]   # no staging left


def test_claim_mounts_its_bound_volume_and_waits_while_unbound(tmp_path: Path) -> None:
    reads = Reads(claims={"weights": "pv-1", "later": ""}, volumes={"pv-1": str(tmp_path / "pv-1")})
    spec = [{"name": "w", "persistentVolumeClaim": {"claimName": "weights"}}]
    assert volume_dirs(reads, pod("p", spec, []), tmp_path / "p", tmp_path)["w"] == tmp_path / "pv-1"
    for claim, message in (("later", "is not bound"), ("none", "not found")):
        with pytest.raises(VolumeNotReady, match=message):
            volume_dirs(reads, pod("p", [{"name": "w", "persistentVolumeClaim": {"claimName": claim}}], []),
                        tmp_path / "p", tmp_path)


def test_mount_of_an_unknown_volume_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no volume named 'gone'"):
        container_mounts({"volumeMounts": [{"name": "gone", "mountPath": "/x"}]}, {})


def run_pod(tmp_path: Path, spec: dict, until, timeout: float = 30) -> tuple[LocalPod, dict]:
    """Tick the pod until ``until(status)``; returns the pod (stopped) and that status."""
    ca = tmp_path / "ca.crt"
    ca.write_text("")
    (tmp_path / "pids").mkdir()
    local = LocalPod(spec, tmp_path / "pods" / spec["metadata"]["name"])
    local.start(Reads(), Apiserver("127.0.0.1", 1, ca), ["kubeinfer"], tmp_path / "pids", tmp_path / "nodes")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            local.tick()
            if until(status := local.status()):
                return local, status
            time.sleep(0.1)
        raise AssertionError(f"pod never reached the state; last status {status}")
    finally:
        local.stop()


def test_init_containers_run_in_order_before_the_container(tmp_path: Path) -> None:
    work = [{"name": "work", "mountPath": "/work"}]
    spec = pod("ordered", [{"name": "work", "emptyDir": {}}],
               [sh("main", "cat /work/order > /work/s; mv /work/s /work/seen; exec sleep 30", work)],
               init=[sh("first", "echo first >> /work/order", work), sh("second", "echo second >> /work/order", work)])
    _, status = run_pod(tmp_path, spec, lambda s: "running" in s["containerStatuses"][0]["state"]
                        and (tmp_path / "pods/ordered/volumes/work/seen").exists())
    assert (tmp_path / "pods/ordered/volumes/work/seen").read_text() == "first\nsecond\n"
    assert [s["state"]["terminated"]["reason"] for s in status["initContainerStatuses"]] == ["Completed"] * 2
    assert {"type": "Initialized", "status": "True"}.items() <= status["conditions"][-1].items()
    assert (tmp_path / "pods/ordered/root/main/work").resolve() == tmp_path / "pods/ordered/volumes/work"


def test_failing_init_container_fails_a_never_restarting_pod_with_its_message(tmp_path: Path) -> None:
    spec = pod("broken", [], [sh("main", "exec sleep 30")], restart="Never",
               init=[sh("fetch", "echo 'repository org/none not found' >&2; exit 3",
                        terminationMessagePolicy="FallbackToLogsOnError")])
    local, status = run_pod(tmp_path, spec, lambda s: s["phase"] == "Failed")
    init, main = status["initContainerStatuses"][0], status["containerStatuses"][0]
    assert init["state"]["terminated"]["exitCode"] == 3  # kubectl shows Init:Error
    assert "repository org/none not found" in init["state"]["terminated"]["message"]
    assert main["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert "main" not in local.containers or local.containers["main"].proc is None


def test_failing_init_container_is_retried_with_back_off(tmp_path: Path) -> None:
    spec = pod("retried", [], [sh("main", "exec sleep 30")], init=[sh("fetch", "exit 4")])
    _, status = run_pod(tmp_path, spec, lambda s: s["initContainerStatuses"][0]["restartCount"] >= 1)
    init = status["initContainerStatuses"][0]
    assert init["state"]["waiting"]["reason"] == "CrashLoopBackOff"  # kubectl: Init:CrashLoopBackOff
    assert init["lastState"]["terminated"]["exitCode"] == 4
    assert status["phase"] == "Pending"


def test_processes_see_their_mounts_through_args_and_env(tmp_path: Path) -> None:
    spec = pod("paths", [{"name": "cache", "hostPath": {"path": "/var/cache/kubeinfer"}}],
               [sh("main", "echo $HOME > /cache/h; mv /cache/h /cache/home; exec sleep 30", [{"name": "cache", "mountPath": "/cache"}],
                   env=[{"name": "HOME", "value": "/cache/home-dir"}])])
    run_pod(tmp_path, spec, lambda s: (tmp_path / "nodes/node-a/var/cache/kubeinfer/home").exists())
    assert (tmp_path / "nodes/node-a/var/cache/kubeinfer/home").read_text().strip() == \
        str(tmp_path / "nodes/node-a/var/cache/kubeinfer/home-dir")


def test_the_runners_own_host_paths_survive_a_mount_at_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster under /tmp (a clean HOME there) and a pod mounting /tmp: the runner's host paths
    (the kubeconfig, the kernel cache) reach the process as they are, not mapped into the volume."""
    kernels = tmp_path / "kernels"
    assert str(kernels).startswith("/tmp/")
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", str(kernels))
    spec = pod("tmpmount", [{"name": "tmp", "emptyDir": {}}],
               [sh("main", "echo $KUBEINFER_CACHE_DIR > /tmp/k; mv /tmp/k /tmp/kernels; exec sleep 30",
                   [{"name": "tmp", "mountPath": "/tmp"}])])
    seen = tmp_path / "pods/tmpmount/volumes/tmp/kernels"
    run_pod(tmp_path, spec, lambda s: seen.exists())
    assert seen.read_text().strip() == str(kernels)
