"""spec → engine Deployment: flags round-trip through the shared table; pods are GPU-, drain-
and security-correct."""

from __future__ import annotations

import argparse

from isvc_builders import CONFIG, make_isvc
import pytest

from kubeinfer.operator.build import deployment
from kubeinfer.operator.children import desired_children, stale_children
from kubeinfer.operator.model_source import EMBEDDED_SERVED_NAME
from kubeinfer.server.flags import ENGINE_FLAGS, SERVER_FLAGS, add_flags
from kubeinfer.server.model.checkpoints.tokenizer_files import EMBEDDED_FILE

pytestmark = pytest.mark.unit


def engine(spec: dict | None = None) -> dict:
    return deployment(make_isvc(spec), CONFIG)["spec"]["template"]["spec"]["containers"][0]


def parsed_args(container: dict) -> argparse.Namespace:
    """Parse the container's args the way `kubeinfer serve` does (env ignored)."""
    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS + SERVER_FLAGS, environ={})
    assert container["command"] == ["kubeinfer"] and container["args"][0] == "serve"
    return parser.parse_args(container["args"][1:])


def test_engine_flags_round_trip_through_the_flag_table() -> None:
    args = parsed_args(engine({
        "model": {"dtype": "float32", "maxModelLen": 2048, "servedName": "smol"},
        "engine": {"device": "cpu", "blockSize": 32, "maxNumSeqs": 8, "kvCacheMemory": "512Mi",
                   "maxNumBatchedTokens": 512, "prefixCache": {"enabled": False}, "quantization": "int8",
                   "kvCacheDtype": "fp8"}}))
    assert (args.model, args.served_model_name, args.dtype, args.device, args.quantization) == \
        ("embedded", "smol", "float32", "cpu", "int8")
    assert args.kv_cache_dtype == "fp8"
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == (32, 8, 512)
    assert args.kv_cache_memory == 512 * 2**20 and args.max_model_len == 2048
    assert args.enable_prefix_caching is False


def test_extra_args_come_last_and_server_flags_are_env() -> None:
    container = engine({"engine": {"extraArgs": ["--seed", "7"],
                                   "env": [{"name": "KUBEINFER_LOG_LEVEL", "value": "debug"},
                                           {"name": "KUBEINFER_HOST", "value": "::"}]}})
    assert container["args"][-2:] == ["--seed", "7"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["KUBEINFER_PORT"] == "8000" and env["KUBEINFER_SHUTDOWN_TIMEOUT"] == "30"
    assert env["KUBEINFER_HOST"] == "::"  # the user's env wins, without a duplicate entry
    assert env["KUBEINFER_LOG_LEVEL"] == "debug"
    assert len(env) == len(container["env"])


def test_server_binds_every_pod_address_so_port_forward_reaches_it() -> None:
    env = {e["name"]: e for e in engine()["env"]}
    assert env["KUBEINFER_HOST"] == {"name": "KUBEINFER_HOST", "value": "0.0.0.0"}


def test_gpu_limit_is_the_tensor_parallel_size_with_shm() -> None:
    dep = deployment(make_isvc({"engine": {"tensorParallelSize": 3},
                                "resources": {"gpuProduct": "NVIDIA-H100-80GB-HBM3"}}), CONFIG)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 3
    assert parsed_args(container).tensor_parallel_size == 3
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_cpu_engine_requests_no_gpu_and_no_shm() -> None:
    pod = deployment(make_isvc({"engine": {"device": "cpu"}}), CONFIG)["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert all(v["name"] != "dshm" for v in pod["volumes"]) and "tolerations" not in pod


def test_pvc_source_mounts_the_claim_read_only() -> None:
    dep = deployment(make_isvc({"model": {"source": "pvc://weights/llama/model.gguf"}}), CONFIG)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} \
        in pod["volumes"]
    assert parsed_args(pod["containers"][0]).model == "/models/llama/model.gguf"


def test_probes_drain_and_restricted_security() -> None:
    dep = deployment(make_isvc({"rollout": {"drainSeconds": 120}}), CONFIG)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    # a new replica takes traffic within ~1 s + 2 s of its load; the same give-up times as before
    startup, readiness = container["startupProbe"], container["readinessProbe"]
    assert (startup["periodSeconds"], readiness["periodSeconds"]) == (1, 2)
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800
    assert readiness["periodSeconds"] * readiness["failureThreshold"] == 16
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + 120
    assert pod["securityContext"]["runAsNonRoot"] and \
        pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["enableServiceLinks"] is False
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"


def test_rollout_and_replicas_follow_the_spec() -> None:
    dep = deployment(make_isvc({"replicas": 4, "rollout": {"maxSurge": "25%", "maxUnavailable": 1}}),
                     CONFIG)
    assert dep["spec"]["replicas"] == 4
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 1}
    assert engine()["image"] == "kubeinfer/kubeinfer:test"
    assert engine({"engine": {"image": "mine:1"}})["image"] == "mine:1"


def test_every_child_is_owned_and_labelled() -> None:
    isvc = make_isvc({"replicas": 2, "routing": {"strategy": "none"}})   # no router: engines only
    children = desired_children(isvc, CONFIG)
    assert [c["kind"] for c in children] == ["Deployment", "Service", "PodDisruptionBudget"]
    for child in children:
        owner = child["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", "uid-1", True)
        assert child["metadata"]["labels"]["kubeinfer.io/inferenceservice"] == "chat"
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubeinfer-operator"
    selector = children[0]["spec"]["selector"]["matchLabels"]
    assert children[1]["spec"]["selector"] == selector
    assert children[2]["spec"]["selector"]["matchLabels"] == selector
    assert isvc.selector == "app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice=chat"


def test_pdb_only_above_one_replica() -> None:
    single = make_isvc({"replicas": 1, "routing": {"strategy": "none"}})
    assert [c["kind"] for c in desired_children(single, CONFIG)] == ["Deployment", "Service"]
    assert ("PodDisruptionBudget", "chat") in stale_children(single)
    assert ("PodDisruptionBudget", "chat") not in stale_children(make_isvc({"replicas": 3}))


def test_builders_are_pure() -> None:
    assert deployment(make_isvc(), CONFIG) == deployment(make_isvc(), CONFIG)


def test_device_auto_asks_for_gpus_only_when_a_gpu_product_is_named() -> None:
    """A spec naming no GPU runs on a cluster without GPUs (the default is auto)."""
    cpu = engine()
    assert parsed_args(cpu).device == "cpu" and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    gpu = engine({"resources": {"gpuProduct": "NVIDIA-L4"}})
    assert parsed_args(gpu).device == "cuda" and gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    forced = engine({"engine": {"device": "cuda"}})
    assert parsed_args(forced).device == "cuda" and forced["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_embedded_model_is_served_under_its_own_name() -> None:
    assert EMBEDDED_FILE.startswith(EMBEDDED_SERVED_NAME + ".")
    assert parsed_args(engine()).served_model_name == EMBEDDED_SERVED_NAME
