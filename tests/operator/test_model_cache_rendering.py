"""hf:// and s3:// sources → the node's model cache: a fetch init container on the cache volume,
the engine reading the same pinned source from it read-only, a preference for warm nodes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from prometheus_client import REGISTRY
from isvc_builders import CONFIG, body, make_isvc
from test_build import parsed_args
from test_reconcile import MemoryKube

from kubeinfer.operator import api, cold_start
from kubeinfer.operator.build import deployment
from kubeinfer.operator.model_pin import ResolveError
from kubeinfer.operator.model_source import cache_key, source_label
from kubeinfer.operator.observe import pod_problems
from kubeinfer.operator.reconcile import Reconciler
from kubeinfer.operator.resource import OperatorConfig
from kubeinfer.server import exit_codes

pytestmark = pytest.mark.unit
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def pod_of(spec: dict, config: OperatorConfig = CONFIG, revision: str | None = None) -> dict:
    isvc = dataclasses.replace(make_isvc(spec), resolved_revision=revision)
    return deployment(isvc, config)["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_hf_source_is_fetched_into_the_node_cache_at_the_resolved_commit() -> None:
    pod = pod_of({"model": {"source": "hf://Qwen/Qwen3-0.6B@main", "tokenSecretRef": {"name": "hf"},
                            "endpoint": "http://hub-mirror.internal:8080"}}, revision=COMMIT)
    fetch, engine = pod["initContainers"][0], pod["containers"][0]
    assert fetch["name"] == api.FETCH_CONTAINER and fetch["command"] == ["kubeinfer"]
    assert fetch["args"] == ["fetch", "--model", f"hf://Qwen/Qwen3-0.6B@{COMMIT}",
                             "--cache-dir", f"{api.MODEL_CACHE_MOUNT}/models"]
    assert env_of(fetch)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env_of(fetch)["HF_ENDPOINT"] == "http://hub-mirror.internal:8080"
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the fetch's error reaches status
    args = parsed_args(engine)
    assert args.model == f"hf://Qwen/Qwen3-0.6B@{COMMIT}" and args.served_model_name == "Qwen/Qwen3-0.6B"
    assert env_of(engine)["HF_HUB_OFFLINE"] == "1" and env_of(engine)["KUBEINFER_CACHE"] == api.MODEL_CACHE_MOUNT
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["hostPath"] == {"path": CONFIG.model_cache_path, "type": "DirectoryOrCreate"}
    assert {"name": "model-cache", "mountPath": api.MODEL_CACHE_MOUNT, "readOnly": True} in engine["volumeMounts"]
    assert {"name": "model-cache", "mountPath": api.MODEL_CACHE_MOUNT} in fetch["volumeMounts"]


def test_a_moved_branch_head_changes_the_template_only_through_a_new_resolution() -> None:
    spec = {"model": {"source": "hf://org/model@main"}}
    assert pod_of(spec, revision=COMMIT) == pod_of(spec, revision=COMMIT)
    assert pod_of(spec, revision=COMMIT) != pod_of(spec, revision="f" * 40)


def test_s3_source_takes_endpoint_and_credentials_secret_for_fetch_and_engine() -> None:
    pod = pod_of({"model": {"source": "s3://weights/llama/8b", "credentialsSecret": "s3-creds",
                            "endpoint": "http://minio.storage:9000"}})
    fetch, engine = pod["initContainers"][0], pod["containers"][0]
    for container in (fetch, engine):
        assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
        assert env_of(container)["AWS_ENDPOINT_URL_S3"] == "http://minio.storage:9000"
    assert "HF_HUB_OFFLINE" not in env_of(engine)
    assert parsed_args(engine).served_model_name == "8b"


def test_chart_settings_pick_a_shared_claim_a_budget_and_a_mirror() -> None:
    config = OperatorConfig(model_cache_claim="models-rwx", model_cache_budget="200Gi",
                            hf_endpoint="http://mirror.internal")
    pod = pod_of({"model": {"source": "hf://org/model"}}, config)
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache") == \
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rwx"}}
    fetch = pod["initContainers"][0]
    assert fetch["args"][-2:] == ["--cache-budget", "200Gi"]
    assert env_of(fetch)["HF_ENDPOINT"] == "http://mirror.internal"
    own = pod_of({"model": {"source": "hf://org/model", "endpoint": "http://own.mirror"}}, config)
    assert env_of(own["initContainers"][0])["HF_ENDPOINT"] == "http://own.mirror"


def test_engine_pods_prefer_nodes_whose_cache_holds_the_weights() -> None:
    user = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}]}}
    spec = {"model": {"source": "hf://org/model"}, "affinity": user}
    isvc = dataclasses.replace(make_isvc(spec), resolved_revision=COMMIT)
    terms = pod_of(spec, revision=COMMIT)["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == user["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert terms[1] == {"weight": 100, "preference": {"matchExpressions": [
        {"key": cache_key(isvc), "operator": "Exists"}]}}
    assert cache_key(isvc).startswith(f"{api.MODEL_LABEL_PREFIX}/") and len(cache_key(isvc).split("/")[1]) == 16
    assert "affinity" not in pod_of({})  # the embedded model needs no cache


class Hub:
    """A resolver whose branch head a test moves; counts the questions."""

    def __init__(self, head: str = COMMIT) -> None:
        self.head, self.asked = head, 0

    def __call__(self, repo: str, revision: str, endpoint: str | None, token: str | None) -> str:
        self.asked += 1
        if repo == "org/missing":
            raise ResolveError("ModelNotFound", f"repository hf://{repo} not found at {endpoint}")
        return self.head


def reconcile(kube: MemoryKube, hub: Hub, spec: dict, generation: int = 1) -> tuple[dict, list]:
    previous = kube.statuses[-1] if kube.statuses else {}
    events = Reconciler(kube, CONFIG, resolve=hub).reconcile(  # type: ignore[arg-type]
        body(spec, generation=generation, status=previous), trigger="update")
    return kube.statuses[-1], events


def engine_model(kube: MemoryKube) -> str:
    return parsed_args(kube.objects[("Deployment", "chat")]["spec"]["template"]["spec"]["containers"][0]).model


def test_branch_resolves_once_per_pod_template_and_scaling_keeps_the_commit() -> None:
    kube, hub = MemoryKube(), Hub()
    spec = {"model": {"source": "hf://org/model@main"}, "replicas": 1}
    status, _ = reconcile(kube, hub, spec)
    assert status["model"]["revision"] == COMMIT and engine_model(kube) == f"hf://org/model@{COMMIT}"
    hub.head = "f" * 40  # the branch moves on the hub
    status, _ = reconcile(kube, hub, {**spec, "replicas": 3}, generation=2)  # scaling: same template
    assert hub.asked == 1 and status["model"]["revision"] == COMMIT and engine_model(kube).endswith(COMMIT)
    status, events = reconcile(kube, hub, {**spec, "replicas": 3, "engine": {"maxNumSeqs": 8}}, generation=3)
    assert hub.asked == 2 and status["model"]["revision"] == "f" * 40 and engine_model(kube).endswith("f" * 40)
    assert ("Normal", "ModelResolved") in [(e.type, e.reason) for e in events]


def test_a_commit_in_the_source_is_never_asked_about() -> None:
    kube, hub = MemoryKube(), Hub()
    status, _ = reconcile(kube, hub, {"model": {"source": f"hf://org/model@{COMMIT}"}})
    assert hub.asked == 0 and status["model"]["revision"] == COMMIT


def test_unknown_repository_is_a_condition_and_an_event_not_a_deployment() -> None:
    kube, hub = MemoryKube(), Hub()
    status, events = reconcile(kube, hub, {"model": {"source": "hf://org/missing@v1"}})
    assert ("Deployment", "chat") not in kube.objects
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ModelNotFound" and "hf://org/missing not found" in degraded["message"]
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "False"
    assert ("Warning", "ModelNotFound") in [(e.type, e.reason) for e in events]


def engine_pod(name: str, created: str, fetch: tuple[str, str] | None, started: str, ready: str | None,
               report: dict | None = None) -> dict:
    """An engine pod's status; `report` is its fetch's termination message (kubeinfer fetch's JSON)."""
    init = [{"name": api.FETCH_CONTAINER, "state": {"terminated": {
        "exitCode": 0, "startedAt": fetch[0], "finishedAt": fetch[1],
        **({"message": json.dumps(report)} if report else {})}}}] if fetch else []
    conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": ready}] if ready else []
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": {"nodeName": "node-a"},
            "status": {"conditions": conditions, "initContainerStatuses": init, "containerStatuses": [
                {"name": api.ENGINE_CONTAINER, "state": {"running": {"startedAt": started}}}]}}


def test_cold_starts_are_reported_once_with_fetch_and_load_times() -> None:
    kube, hub = MemoryKube(), Hub()
    kube.listed["Pod"] = [
        engine_pod("cold", "2026-01-01T00:00:00Z", ("2026-01-01T00:00:02Z", "2026-01-01T00:00:32Z"),
                   "2026-01-01T00:00:33Z", "2026-01-01T00:00:40Z"),
        engine_pod("starting", "2026-01-01T00:01:00Z", None, "2026-01-01T00:01:01Z", None)]
    spec = {"model": {"source": "hf://org/model@main"}}
    status, events = reconcile(kube, hub, spec)
    last = status["model"]["lastColdStart"]
    assert (last["pod"], last["fetchSeconds"], last["loadSeconds"], last["totalSeconds"]) == ("cold", 30, 7, 40)
    assert [e.message for e in events if e.reason == "ColdStart"] == \
        ["pod cold on node-a: fetch 30 s, engine load 7 s, Ready 40 s after creation"]
    kube.listed["Pod"].append(engine_pod("warm", "2026-01-01T00:02:00Z", ("2026-01-01T00:02:01Z",
                              "2026-01-01T00:02:01Z"), "2026-01-01T00:02:02Z", "2026-01-01T00:02:06Z"))
    status, events = reconcile(kube, hub, spec)
    assert [e.message.split(":")[0] for e in events if e.reason == "ColdStart"] == ["pod warm on node-a"]
    assert status["model"]["lastColdStart"]["fetchSeconds"] == 0


def test_cold_start_splits_the_fetch_into_cache_wait_and_download_with_its_bytes() -> None:
    kube, hub = MemoryKube(), Hub()
    labels = {"namespace": "team-a", "inferenceservice": "chat"}
    bytes_before = REGISTRY.get_sample_value("kubeinfer:model_download_bytes_total", labels) or 0
    waits_before = REGISTRY.get_sample_value("kubeinfer:model_cache_wait_seconds_sum", labels) or 0
    kube.listed["Pod"] = [engine_pod(
        "cold", "2026-01-01T00:00:00Z", ("2026-01-01T00:00:02Z", "2026-01-01T00:00:32Z"), "2026-01-01T00:00:33Z",
        "2026-01-01T00:00:40Z", {"revision": COMMIT, "bytes_downloaded": 2_150_000_000, "lock_wait_seconds": 4.0,
                                 "download_seconds": 25.5, "evicted": [], "seconds": 30.0})]
    status, events = reconcile(kube, hub, {"model": {"source": "hf://org/model@main"}})
    last = status["model"]["lastColdStart"]
    assert (last["cacheWaitSeconds"], last["downloadSeconds"], last["bytesDownloaded"]) == (4, 25.5, 2_150_000_000)
    assert [e.message for e in events if e.reason == "ColdStart"] == [
        "pod cold on node-a: fetch 30 s (cache wait 4 s, downloaded 2.15 GB in 26 s), engine load 7 s, "
        "Ready 40 s after creation"]
    assert REGISTRY.get_sample_value("kubeinfer:model_download_bytes_total", labels) - bytes_before == 2_150_000_000
    assert REGISTRY.get_sample_value("kubeinfer:model_cache_wait_seconds_sum", labels) - waits_before == 4.0


def test_s3_revision_in_status_is_the_listing_digest_the_latest_fetch_found() -> None:
    kube, hub = MemoryKube(), Hub()
    spec = {"model": {"source": "s3://weights/llama"}}
    kube.listed["Pod"] = [engine_pod("a", "2026-01-01T00:00:00Z", ("2026-01-01T00:00:02Z", "2026-01-01T00:00:03Z"),
                                     "2026-01-01T00:00:04Z", "2026-01-01T00:00:09Z",
                                     {"revision": "d1" * 32, "bytes_downloaded": 0})]
    status, _ = reconcile(kube, hub, spec)
    assert status["model"]["revision"] == "d1" * 32 and hub.asked == 0
    status, _ = reconcile(kube, hub, spec)   # nothing new reported: the digest stays
    assert status["model"]["revision"] == "d1" * 32


def test_a_fetch_that_evicted_a_model_removes_its_label_from_the_node() -> None:
    kube, hub = MemoryKube(), Hub()
    evicted = f"hf://org/other@{'e' * 40}"
    kube.listed["Node"] = [node("node-a", {source_label(evicted): "true", "keep": "me"})]
    kube.listed["Pod"] = [engine_pod("a", "2026-01-01T00:00:00Z", ("2026-01-01T00:00:02Z", "2026-01-01T00:00:03Z"),
                                     "2026-01-01T00:00:04Z", "2026-01-01T00:00:09Z",
                                     {"revision": COMMIT, "bytes_downloaded": 10, "evicted": [evicted]})]
    reconcile(kube, hub, {"model": {"source": "hf://org/model@main"}})
    assert kube.listed["Node"][0]["metadata"]["labels"] == {"kubernetes.io/hostname": "node-a", "keep": "me"}


def test_a_fetch_report_that_is_not_json_is_ignored() -> None:
    pod = engine_pod("a", "2026-01-01T00:00:00Z", ("2026-01-01T00:00:02Z", "2026-01-01T00:00:03Z"),
                     "2026-01-01T00:00:04Z", "2026-01-01T00:00:09Z")
    pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["message"] = "downloaded [1, 2"
    assert cold_start.fetch_report(pod) == cold_start.FetchReport()
    start = cold_start.cold_start(pod)
    assert start is not None and start.bytes_downloaded is None and start.fetch_seconds == 1


def test_failed_fetch_names_the_problem_from_its_exit_code() -> None:
    pod = {"metadata": {"name": "chat-1"}, "status": {"initContainerStatuses": [{
        "name": api.FETCH_CONTAINER, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": exit_codes.MODEL_CACHE_FULL, "message":
                                     "kubeinfer: ModelCacheFull: 16 GB needed, 2 GB free in /var/cache/kubeinfer"}}}]}}
    reason, message = pod_problems([pod])[0]
    assert reason == "ModelCacheFull" and "16 GB needed, 2 GB free" in message and "fetch-model" in message


def node(name: str, labels: dict | None = None) -> dict:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}}


def test_warm_ahead_runs_a_fetch_job_per_node_and_labels_the_nodes_that_hold_the_weights() -> None:
    kube, hub = MemoryKube(), Hub()
    spec = {"model": {"source": "hf://org/model@main", "cache": {"nodes": 1}}, "nodeSelector": {"pool": "gpu"}}
    isvc = dataclasses.replace(make_isvc(spec), resolved_revision=COMMIT)
    kube.listed["Node"] = [node("a", {"pool": "gpu"}), node("b", {"pool": "gpu", cache_key(isvc): "true"}),
                           node("c")]
    status, _ = reconcile(kube, hub, spec)
    jobs = [obj for (kind, _), obj in kube.objects.items() if kind == "Job"]
    assert len(jobs) == 1 and jobs[0]["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "b"}
    fetch = jobs[0]["spec"]["template"]["spec"]["containers"][0]
    assert fetch["args"][:3] == ["fetch", "--model", f"hf://org/model@{COMMIT}"]
    assert status["model"]["cachedNodes"] == ["b"]
    jobs[0]["status"] = {"succeeded": 1}
    ready = {"metadata": {"name": "chat-x"}, "spec": {"nodeName": "a", "initContainers": [fetch]},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    kube.listed.update({"Job": jobs, "Pod": [ready]})
    status, _ = reconcile(kube, hub, spec)
    assert status["model"]["cachedNodes"] == ["a", "b"]  # a: an engine pod of these weights is Ready there
    assert cache_key(isvc) in kube.listed["Node"][0]["metadata"]["labels"]
    reconcile(kube, hub, {**spec, "model": {**spec["model"], "cache": {"nodes": 0}}})
    assert not [k for k in kube.objects if k[0] == "Job"]  # no warm-ahead asked: its Jobs go
