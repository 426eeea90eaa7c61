"""Replicas that span pods: a LeaderWorkerSet group per replica, its leader the only pod the
Service, the router and the autoscaler see; without the LWS CRD a condition says how to install it."""

from __future__ import annotations

import pytest
from isvc_builders import CONFIG, body, make_isvc
from pydantic import ValidationError
from test_reconcile import MemoryKube, conditions

from kubeinfer.operator import api
from kubeinfer.operator.build import deployment, workload
from kubeinfer.operator.children import desired_children, stale_children
from kubeinfer.operator.observe import lws_as_workload
from kubeinfer.operator.reconcile import Reconciler
from kubeinfer.server.kube.api import label_selector
from kubeinfer.server.kube.scale import engine_selector

pytestmark = pytest.mark.unit

GROUP_SPEC = {"engine": {"device": "cuda", "tensorParallelSize": 8, "pipelineParallelSize": 2, "podsPerReplica": 2},
              "exclusiveTopology": "kubernetes.io/hostname", "replicas": 3}


def _engine(pod: dict) -> dict:
    return pod["containers"][0]


def test_single_pod_replicas_render_the_deployment_as_before() -> None:
    isvc = make_isvc({"engine": {"tensorParallelSize": 2}})
    rendered = workload(isvc, CONFIG)
    assert rendered == deployment(isvc, CONFIG) and rendered["kind"] == "Deployment"
    args = _engine(rendered["spec"]["template"]["spec"])["args"]
    assert not {"--pipeline-parallel-size", "--nnodes", "--headless"} & set(args)
    assert ("LeaderWorkerSet", "chat") not in stale_children(isvc)   # no LWS CRD: nothing to look for


def test_multi_pod_replicas_render_a_leader_worker_set() -> None:
    lws = workload(make_isvc(GROUP_SPEC), CONFIG)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["metadata"]["annotations"] == {api.LWS_EXCLUSIVE_TOPOLOGY: "kubernetes.io/hostname"}
    spec = lws["spec"]
    group = spec["leaderWorkerTemplate"]
    assert spec["replicas"] == 3 and group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}   # LWS's shared one is named "chat"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == api.WORKER_COMPONENT
    leader_engine, worker_engine = _engine(leader["spec"]), _engine(worker["spec"])
    group_flags = ["--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                   "--master-port", str(api.MASTER_PORT)]
    leader_args = leader_engine["args"]
    assert leader_args[-len(group_flags):] == group_flags
    assert leader_args[leader_args.index("--tensor-parallel-size") + 1] == "8"
    assert leader_args[leader_args.index("--pipeline-parallel-size") + 1] == "2"
    assert worker_engine["args"] == [*leader_args, "--headless"]
    assert leader_engine["resources"]["limits"]["nvidia.com/gpu"] == 8   # 16 ranks over 2 pods
    assert worker_engine["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "readinessProbe" in leader_engine and leader_engine["ports"]
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(worker_engine)


def test_only_leaders_are_behind_the_service_router_and_autoscaler() -> None:
    isvc = make_isvc(GROUP_SPEC)
    selector = engine_selector(body(GROUP_SPEC))   # what the autoscaler and the router list
    worker = set(label_selector(isvc.worker_labels).split(","))
    assert set(selector.split(",")) <= set(label_selector(isvc.labels).split(","))
    assert not set(selector.split(",")) <= worker
    children = {c["kind"]: c for c in desired_children(isvc, CONFIG) if c["metadata"]["name"] == "chat"}
    pdb = children["PodDisruptionBudget"]["spec"]   # one pod at a time: at most one group broken
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchExpressions"][0]["values"] == ["engine", api.WORKER_COMPONENT]
    assert ("Deployment", "chat") in stale_children(isvc)


def test_a_group_counts_as_one_replica_in_status() -> None:
    lws = {"kind": "LeaderWorkerSet", "metadata": {"name": "chat", "generation": 4},
           "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3}}
    kube = MemoryKube()
    kube.objects[("CustomResourceDefinition", api.LWS_CRD)] = {"metadata": {"name": api.LWS_CRD}}
    Reconciler(kube, CONFIG).reconcile(body(GROUP_SPEC), trigger="create")  # type: ignore[arg-type]
    assert kube.objects[("LeaderWorkerSet", "chat")]["spec"]["replicas"] == 3
    kube.objects[("LeaderWorkerSet", "chat")] = {**kube.objects[("LeaderWorkerSet", "chat")], **lws}
    Reconciler(kube, CONFIG).reconcile(body(GROUP_SPEC), trigger="pod", apply=False)  # type: ignore[arg-type]
    status = kube.statuses[-1]
    assert (status["replicas"], status["readyReplicas"], status["replicaSummary"]) == (3, 2, "2/3")
    assert conditions(status)["Ready"] == "True/Available"
    assert lws_as_workload(lws)["status"]["availableReplicas"] == 2


def test_without_the_lws_crd_a_condition_says_what_to_install() -> None:
    kube = MemoryKube()   # no CustomResourceDefinition leaderworkersets.leaderworkerset.x-k8s.io
    Reconciler(kube, CONFIG).reconcile(body(GROUP_SPEC), trigger="create")  # type: ignore[arg-type]
    assert ("LeaderWorkerSet", "chat") not in kube.objects and ("Deployment", "chat") not in kube.objects
    status = kube.statuses[-1]
    found = conditions(status)
    assert found["Ready"] == "False/LeaderWorkerSetMissing" and found["Degraded"] == "True/LeaderWorkerSetMissing"
    message = next(c["message"] for c in status["conditions"] if c["type"] == "Degraded")
    assert api.LWS_CRD in message and api.LWS_INSTALL in message


@pytest.mark.parametrize("spec, message", [
    ({"engine": {"tensorParallelSize": 4, "pipelineParallelSize": 1, "podsPerReplica": 3}}, "spread evenly"),
    ({"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 2}}, "at most 8"),
    ({"exclusiveTopology": "kubernetes.io/hostname"}, "needs engine.podsPerReplica > 1"),
    ({"engine": {"pipelineParallelSize": 2, "lora": {"enabled": True}}}, "pipelineParallelSize > 1"),
    ({"engine": {"podsPerReplica": 2, "tensorParallelSize": 2,
                 "speculative": {"method": "draft_model", "draftModel": "pvc://models/draft"}}}, "draft_model"),
])
def test_layouts_that_cannot_work_are_refused(spec, message) -> None:
    with pytest.raises(ValidationError, match=message):
        make_isvc(spec)
