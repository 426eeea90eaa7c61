"""API keys on an InferenceService (issue #28, item 8; tenants' keys, issue #42) on the local
cluster, from the Helm chart.

A Secret holds the key; `spec.auth.apiKeySecretRef` points at it. With engines running, and at
zero replicas through the gateway, requests without the key get OpenAI's 401 and requests with
it get 200; a keyless request never wakes a service at zero; and the key is in no pod's
arguments, no `kubectl get pod -o yaml`, no process command line and no log line. The local
cluster has no kube-proxy, so the tests talk to the pod IPs the Service's endpoints hold.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
KEY = "sk-e2e-" + secrets.token_hex(16)  # random: any hit in a log can only come from here
SECRET = "llm-api-keys"
CHAT = {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> str:
    """The chart as test_operator.py installs it (same values, so either may run first)."""
    cluster.install_chart("operator.driftIntervalSeconds=15")
    return SYSTEM_NS


def apply(cluster: Cluster, namespace: str, obj: dict[str, Any]) -> None:
    """Through stdin, so the key is never on a command line."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(obj))


def keyed_service(cluster: Cluster, namespace: str, name: str, scale_to_zero: bool,
                  secret: str = SECRET, keys: str | None = f"# e2e key\n{KEY}\n") -> None:
    if keys is not None:
        apply(cluster, namespace, {"apiVersion": "v1", "kind": "Secret",
                                   "metadata": {"name": secret}, "stringData": {"api-keys": keys}})
    spec: dict[str, Any] = {
        "model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
        "engine": {"device": "cpu", "kvCacheMemory": "64Mi", "maxNumSeqs": 2,
                   "maxNumBatchedTokens": 256},
        "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1,
        "auth": {"apiKeySecretRef": {"name": secret}}}
    if scale_to_zero:  # KEDA-style: nothing but the gateway scales it, so it stays at zero
        spec.update(replicas=0, autoscaling={"enabled": False, "minReplicas": 0,
                                             "activationTimeoutSeconds": 600})
    apply(cluster, namespace, {"apiVersion": "kubeinfer.io/v1alpha1",
                               "kind": "InferenceService", "metadata": {"name": name},
                               "spec": spec})


def ready_pod_url(cluster: Cluster, namespace: str, selector: str, port: int) -> str:
    pod = wait_for(lambda: next((p for p in cluster.pods(namespace, selector) if pod_ready(p)),
                                None), f"a Ready pod {selector}", timeout=900, interval=2)
    return f"http://{pod.status.pod_ip}:{port}"


def chat(url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers, timeout=900)


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


def picker_answer(address: str, key: str | None) -> tuple[int, dict[str, str]]:
    """What kubeinfer's endpoint picker (`address`: its ext_proc ip:port) tells Envoy about a chat
    request with `key`: (0, the headers it sets) when it routes it, else (the immediate
    response's status, its headers)."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
             *([("authorization", f"Bearer {key}")] if key else [])]
    messages = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(CHAT).encode(), end_of_stream=True))]
    with grpc.insecure_channel(address) as channel:
        first = next(iter(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=30)))
    if first.HasField("immediate_response"):
        answer = first.immediate_response
        return answer.status.code, {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    return 0, {h.header.key: h.header.raw_value.decode()
               for h in first.request_headers.response.header_mutation.set_headers}


def assert_admin_refused(url: str) -> None:
    """Issue #37: what only the operator and the routers use is refused with a user's key too."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path in (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                         ("GET", "/kv/blocks"), ("GET", "/tokenizer_info")):
        response = httpx.request(method, url + path, headers=headers, timeout=30,
                                 json={"lora_name": "x", "lora_path": "/etc"})
        assert response.status_code in (403, 404), (url, path, response.text)


def assert_key_hidden(cluster: Cluster, namespace: str) -> None:
    """Not in the pod specs, not on any command line (`ps`), not in any log line."""
    pods = cluster.kubectl_json("get", "pods", "-n", namespace)["items"]
    assert pods and KEY not in json.dumps(pods)
    refs = [env["valueFrom"]["secretKeyRef"] for pod in pods
            for container in pod["spec"]["containers"] for env in container.get("env", [])
            if env["name"] == "KUBEINFER_API_KEYS"]
    assert refs and all(ref == {"name": SECRET, "key": "api-keys"} for ref in refs)
    for pod in pods:
        for container in pod["spec"]["containers"]:
            assert not any("api-key" in arg for arg in container.get("args", []))
    processes = subprocess.run(["ps", "-eww", "-o", "args="], capture_output=True, text=True,
                               check=True).stdout
    assert "kubeinfer.server.cli serve" in processes or "kubeinfer serve" in processes
    assert KEY not in processes
    state = cluster.config.state_dir
    logs = [*state.glob("pods/*/*.log"), *state.glob("logs/*")]
    ours = [log for log in logs if log.parent.name.startswith(namespace + "_")]
    assert ours, f"no pod logs of {namespace} under {state / 'pods'}"
    for log in logs:
        assert KEY not in log.read_text(errors="replace"), f"the API key is in {log}"
    engine_logs = "".join(log.read_text(errors="replace") for log in ours)
    assert "API keys required on the OpenAI routes (1 configured)" in engine_logs


def test_engine_answers_401_without_the_key_and_200_with_it(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    keyed_service(local_cluster, namespace, "keyed", scale_to_zero=False)
    url = ready_pod_url(local_cluster, namespace, "app.kubernetes.io/component=engine", 8000)
    assert_refused(chat(url, None))
    assert_refused(chat(url, "sk-wrong"))
    answer = chat(url, KEY)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    for path in ("/health", "/ready", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path
    assert_admin_refused(url)   # this Service selects the engines' API port
    assert_key_hidden(local_cluster, namespace)
    explained = local_cluster.kubectl("explain", "inferenceservice.spec.auth.apiKeySecretRef").stdout
    assert "never as an argument" in " ".join(explained.split())  # explain wraps lines


def test_gateway_refuses_keyless_requests_without_waking_and_forwards_keyed_ones(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    keyed_service(local_cluster, namespace, "keyed", scale_to_zero=True)
    url = ready_pod_url(local_cluster, namespace, "app.kubernetes.io/component=gateway", 8080)
    service = local_cluster.kubectl_json("get", "service", "keyed", "-n", namespace)
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"

    assert_refused(chat(url, None))
    assert_refused(chat(url, "sk-wrong"))
    # The key is checked before the activator, which patches spec.replicas before it answers:
    # had a refused request woken the service, the patch and the activation count would be
    # visible now, no wait needed.
    assert "kubeinfer_gateway_activations_total 0.0" in httpx.get(f"{url}/metrics", timeout=10).text
    isvc = local_cluster.kubectl_json("get", "inferenceservice", "keyed", "-n", namespace)
    assert isvc["spec"]["replicas"] == 0
    assert not local_cluster.pods(namespace, "app.kubernetes.io/component=engine")

    answer = chat(url, KEY)  # held while the engine starts and loads the model
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    assert_refused(chat(url, "sk-wrong"))  # and with the engine up
    assert_admin_refused(url)   # the Service's router
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "kubeinfer_gateway_activations_total 1.0" in metrics
    assert 'kubeinfer_gateway_requests_total{code="401"} 3.0' in metrics
    assert_key_hidden(local_cluster, namespace)


def test_a_missing_or_keyless_secret_never_serves_open(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    keyed_service(local_cluster, namespace, "missing", False, secret="absent", keys=None)
    keyed_service(local_cluster, namespace, "keyless", False, secret="keyless",
                  keys="# no key yet\n\n")

    def degraded(name: str) -> dict[str, Any] | None:
        obj = local_cluster.kubectl_json("get", "inferenceservice", name, "-n", namespace)
        found = [c for c in (obj.get("status") or {}).get("conditions", [])
                 if c["type"] == "Degraded" and c["status"] == "True"]
        return found[0] if found else None

    missing = wait_for(lambda: degraded("missing"), "missing Degraded", timeout=120, interval=1)
    assert missing["reason"] == "CreateContainerConfigError" and "absent" in missing["message"]
    keyless = wait_for(lambda: degraded("keyless"), "keyless Degraded", timeout=300, interval=2)
    assert keyless["reason"] == "CrashLoopBackOff"
    assert "no API key is configured" in keyless["message"]
    assert not any(pod_ready(p) for p in local_cluster.pods(namespace))


def test_inline_tenant_table_names_tenants_by_keys_kept_in_a_secret(
        local_cluster: Cluster, operator: str, namespace: str) -> None:
    """spec.tenancy.tenants: the names, priorities and quotas in the spec, the keys in a Secret
    the pods mount (the operator never reads it); the router, the endpoint picker
    (spec.inferencePool: what Envoy asks over ext_proc) and the engine all admit a tenant's key,
    refuse a wrong one (401) and hold a request-per-minute quota (429). The API server refuses
    inconsistent tables with the CRD's messages."""
    for tenancy, message in (
            ({"tenantsSecretRef": {"name": "teams"}, "tenants": [{"name": "team-a"}]}, "mutually exclusive"),
            ({"tenants": [{"name": "team-a"}, {"name": "team-a"}]}, "tenancy.tenants[].name must be unique"),
            ({"priorityRange": {"min": 0, "max": 3}, "tenants": [{"name": "a", "priority": 7}]},
             "tenancy.tenants[].priority must lie within tenancy.priorityRange"),
            ({"objectives": {"batch": 101}}, "tenancy.objectives must lie within tenancy.priorityRange"),
            ({"priorityRange": {"min": 3, "max": 1}}, "min must not exceed")):
        bad = {"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "bad"},
               "spec": {"tenancy": tenancy}}
        refused = local_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                                        stdin=json.dumps(bad), check=False)
        assert refused.returncode != 0 and message in refused.stderr, refused.stderr
    team_key = "sk-team-" + secrets.token_hex(8)
    apply(local_cluster, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-keys"},
                                     "stringData": {"team-a": f"{team_key}\n", "team-b": "sk-b\n"}})
    apply(local_cluster, namespace, {
        "apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "tenants"},
        "spec": {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
                 "engine": {"device": "cpu", "kvCacheMemory": "64Mi", "maxNumSeqs": 2, "maxNumBatchedTokens": 256},
                 "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1, "routing": {"replicas": 1},
                 "inferencePool": {"enabled": True},
                 "tenancy": {"priorityRange": {"min": 0, "max": 10}, "tenants": [
                     {"name": "team-a", "priority": 2, "quotas": {"requestsPerMinute": 2},
                      "apiKeysSecretRef": {"name": "team-keys", "key": "team-a"}},
                     {"name": "team-b", "apiKeysSecretRef": {"name": "team-keys", "key": "team-b"}}]}}})
    engine = ready_pod_url(local_cluster, namespace, "app.kubernetes.io/component=engine", 8000)
    router = ready_pod_url(local_cluster, namespace, "app.kubernetes.io/component=gateway", 8080)
    picker = ready_pod_url(local_cluster, namespace, "app.kubernetes.io/component=endpoint-picker", 9002)
    picker = picker.removeprefix("http://")
    assert_refused(chat(router, "sk-wrong"))
    assert_refused(chat(engine, "sk-wrong"))
    status, headers = picker_answer(picker, "sk-wrong")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    status, headers = picker_answer(picker, team_key)   # routed to the engine, then held to its share
    assert status == 0 and headers["x-gateway-destination-endpoint"] == engine.removeprefix("http://")
    status, headers = picker_answer(picker, team_key)
    assert status == 429 and headers["x-kubeinfer-rate-limit"] == "requests_per_minute", headers
    refused = {(s.labels["tenant"], s.labels["outcome"]): s.value
               for family in text_string_to_metric_families(httpx.get(
                   f"http://{picker.rsplit(':', 1)[0]}:9090/metrics", timeout=10).text)
               if family.name == "kubeinfer:tenant_requests" for s in family.samples if s.name.endswith("_total")}
    assert refused == {("team-a", "rate_limited"): 1}
    answer = chat(router, team_key)   # admitted by the router, then by the engine
    assert answer.status_code == 200, answer.text
    # 2 a minute, spread evenly: each of them now refuses team-a for ~30 s
    for url in (engine, router):
        limited = chat(url, team_key)
        assert limited.status_code == 429 and limited.headers["x-kubeinfer-rate-limit"] == "requests_per_minute"
        assert int(limited.headers["retry-after"]) >= 1
    assert chat(engine, "sk-b").status_code == 200   # team-b has no quota
    outcomes = {(sample.labels["tenant"], sample.labels["outcome"]): sample.value
                 for family in text_string_to_metric_families(httpx.get(f"{engine}/metrics", timeout=10).text)
                 if family.name == "kubeinfer:tenant_requests" for sample in family.samples
                 if sample.name.endswith("_total")}
    served = {tenant: sum(value for (name, outcome), value in outcomes.items()
                          if name == tenant and outcome in ("stop", "length")) for tenant in ("team-a", "team-b")}
    assert outcomes[("team-a", "rate_limited")] == 1 and served == {"team-a": 1, "team-b": 1}, outcomes
    pods = json.dumps(local_cluster.kubectl_json("get", "pods", "-n", namespace)["items"])
    assert team_key not in pods and "team-a" in pods

    # Rotation: team-b's key changes in the Secret under the running pods; the synced volume
    # reaches the engine and the router, which apply it without a restart.
    running = {pod.metadata.uid for pod in local_cluster.pods(namespace)}
    rotated = "sk-b-" + secrets.token_hex(8)
    apply(local_cluster, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-keys"},
                                     "stringData": {"team-a": f"{team_key}\n", "team-b": f"{rotated}\n"}})
    wait_for(lambda: all(chat(url, rotated).status_code == 200 for url in (engine, router))
             and picker_answer(picker, rotated)[0] == 0,
             "the rotated key admitted by the engine, the router and the endpoint picker", timeout=120, interval=1)
    for url in (engine, router):
        assert_refused(chat(url, "sk-b"))
    assert picker_answer(picker, "sk-b")[0] == 401
    pods = local_cluster.pods(namespace)
    assert {pod.metadata.uid for pod in pods} == running
    assert all(status.restart_count == 0 for pod in pods for status in pod.status.container_statuses or [])
