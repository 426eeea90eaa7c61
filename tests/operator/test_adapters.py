"""spec.adapters reach running engines through vLLM's runtime API: planned from what each
engine reports, idempotent, re-loaded after an engine restart, failures in status and Events."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from isvc_builders import CONFIG, body, make_isvc
from test_build import parsed_args
from test_reconcile import MemoryKube, conditions

from kubeinfer.operator.adapter_sync import AdapterSync
from kubeinfer.operator.adapters import Action, adapter_condition, engine_adapters, plan
from kubeinfer.operator.build import deployment
from kubeinfer.operator.events import transition_events
from kubeinfer.operator.reconcile import Reconciler

pytestmark = pytest.mark.unit

BASE = "SmolLM2-135M-Instruct"
ADAPTERS = [{"name": "sql", "source": "pvc://loras/sql"}, {"name": "chat", "source": "pvc://loras/chat"}]


class FakeEngine:
    """An engine's LoRA routes with vLLM's shapes; `refuse` maps a path to the 400 it answers."""

    def __init__(self, refuse: dict[str, str] | None = None) -> None:
        self.adapters: dict[str, str] = {}
        self.refuse = refuse or {}
        self.calls: list[str] = []
        self.auth: list[str | None] = []
        self.ports: set[int | None] = set()

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.auth.append(request.headers.get("authorization"))
        self.ports.add(request.url.port)
        if request.url.path == "/v1/models":
            cards = [{"id": BASE, "object": "model", "root": BASE, "parent": None}] + [
                {"id": name, "object": "model", "root": path, "parent": BASE} for name, path in self.adapters.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        payload = json.loads(request.content)
        name = payload["lora_name"]
        self.calls.append(f"{request.url.path.split('/')[-1]} {name}")
        if request.url.path == "/v1/load_lora_adapter":
            if payload["lora_path"] in self.refuse:
                return httpx.Response(400, json={"error": {"message": self.refuse[payload["lora_path"]],
                                                           "type": "BadRequestError", "code": 400}})
            if name in self.adapters:
                return httpx.Response(400, json={"error": {
                    "message": f"The lora adapter '{name}' has already been loaded.", "code": 400}})
            self.adapters[name] = payload["lora_path"]
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if name not in self.adapters:
            return httpx.Response(404, json={"error": {"message": f"The lora adapter '{name}' cannot be found."}})
        del self.adapters[name]
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")


class Engines:
    """Engine pods by IP behind one mock transport."""

    def __init__(self, **engines: FakeEngine) -> None:
        self.by_ip = engines

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(
            lambda request: self.by_ip[request.url.host].handle(request)))


def engine_pod(name: str, ip: str, ready: bool = True) -> dict[str, Any]:
    """A LoRA engine pod as the kubelet reports it: its containers answer (ContainersReady) while
    Ready waits for the adapters gate."""
    return {"metadata": {"name": name},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000},
                                                                 {"name": "admin", "containerPort": 8001}]}],
                     "readinessGates": [{"conditionType": "kubeinfer.io/adapters-loaded"}]},
            "status": {"podIP": ip, "conditions": [{"type": "ContainersReady", "status": str(ready)},
                                                   {"type": "Ready", "status": "False"}]}}


def sync(engines: Engines, spec: dict[str, Any], pods: list[dict[str, Any]]):
    return AdapterSync(engines.client()).sync(make_isvc(spec), pods)


def test_plan_loads_what_is_missing_and_unloads_what_was_removed() -> None:
    desired = {"sql": "/adapters/l/sql", "chat": "/adapters/l/chat"}
    assert plan(desired, {}) == [Action("load", "chat", "/adapters/l/chat"), Action("load", "sql", "/adapters/l/sql")]
    assert plan(desired, {"sql": "/adapters/l/sql", "chat": "/adapters/l/chat"}) == []
    assert plan({"sql": "/adapters/l/sql"}, {"sql": "/adapters/l/sql", "old": "/adapters/l/old"}) == [
        Action("unload", "old")]
    assert plan({}, {"baked": "/opt/loras/baked", "was-on-model-claim": "/models/loras/x"}) == [
        Action("unload", "was-on-model-claim")]   # an engine.extraArgs --lora-modules adapter stays
    # a moved source is unloaded, then loaded from its new path; an unknown root is trusted
    assert plan({"sql": "/adapters/l/sql-v2"}, {"sql": "/adapters/l/sql"}) == [
        Action("unload", "sql"), Action("load", "sql", "/adapters/l/sql-v2")]
    assert plan({"sql": "/adapters/l/sql"}, {"sql": None}) == []


def test_engine_adapters_are_the_models_with_a_parent() -> None:
    models = {"data": [{"id": BASE, "root": BASE, "parent": None}, {"id": "sql", "root": "/a/sql", "parent": BASE}]}
    assert engine_adapters(models) == {"sql": "/a/sql"}


def test_sync_loads_into_every_ready_pod_and_is_idempotent() -> None:
    a, b, starting = FakeEngine(), FakeEngine(), FakeEngine()
    engines = Engines(**{"10.0.0.1": a, "10.0.0.2": b, "10.0.0.3": starting})
    pods = [engine_pod("chat-a", "10.0.0.1"), engine_pod("chat-b", "10.0.0.2"),
            engine_pod("chat-c", "10.0.0.3", ready=False)]
    report = sync(engines, {"adapters": ADAPTERS}, pods)
    assert a.adapters == b.adapters == {"sql": "/adapters/loras/sql", "chat": "/adapters/loras/chat"}
    assert starting.calls == [] and [p.pod for p in report.pods] == ["chat-a", "chat-b"]
    assert adapter_condition(make_isvc({"adapters": ADAPTERS}), report)[1:3] == (True, "AdaptersLoaded")
    before = list(a.calls)
    sync(engines, {"adapters": ADAPTERS}, pods)
    assert a.calls == before   # nothing to do: only /v1/models was read


def test_a_restarted_engine_gets_its_adapters_back() -> None:
    engine = FakeEngine()
    engines, pods = Engines(**{"10.0.0.1": engine}), [engine_pod("chat-a", "10.0.0.1")]
    sync(engines, {"adapters": ADAPTERS}, pods)
    engine.adapters.clear()   # a container restart loses runtime loads
    report = sync(engines, {"adapters": ADAPTERS}, pods)
    assert set(engine.adapters) == {"sql", "chat"} and report.pods[0].held == {"sql", "chat"}


def test_removing_an_adapter_unloads_it() -> None:
    engine = FakeEngine()
    engines, pods = Engines(**{"10.0.0.1": engine}), [engine_pod("chat-a", "10.0.0.1")]
    sync(engines, {"adapters": ADAPTERS}, pods)
    report = sync(engines, {"adapters": ADAPTERS[:1]}, pods)
    assert engine.adapters == {"sql": "/adapters/loras/sql"} and engine.calls[-1] == "unload_lora_adapter chat"
    assert [(a.kind, a.name) for a in report.pods[0].done] == [("unload", "chat")]


def test_adapter_on_the_model_claim_is_loaded_from_the_model_mount() -> None:
    engine = FakeEngine()
    spec = {"model": {"source": "pvc://weights/base"}, "adapters": [{"name": "sql", "source": "pvc://weights/loras/sql"}]}
    sync(Engines(**{"10.0.0.1": engine}), spec, [engine_pod("chat-a", "10.0.0.1")])
    assert engine.adapters == {"sql": "/models/loras/sql"}


def test_a_failed_load_is_a_condition_with_the_engines_error() -> None:
    message = "LoRA rank 64 is greater than max_lora_rank 16."
    engine = FakeEngine(refuse={"/adapters/loras/sql": message})
    report = sync(Engines(**{"10.0.0.1": engine}), {"adapters": ADAPTERS}, [engine_pod("chat-a", "10.0.0.1")])
    assert report.pods[0].held == {"chat"}   # the other adapter still loads
    _, ok, reason, text = adapter_condition(make_isvc({"adapters": ADAPTERS}), report)
    assert (ok, reason) == (False, "AdapterLoadFailed")
    assert text == f"adapter sql in pod chat-a: HTTP 400: {message}"


def test_an_unreachable_engine_is_reported_not_counted() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)
    client = httpx.Client(transport=httpx.MockTransport(refuse))
    report = AdapterSync(client).sync(make_isvc({"adapters": ADAPTERS}), [engine_pod("chat-a", "10.0.0.1")])
    assert adapter_condition(make_isvc({"adapters": ADAPTERS}), report)[1:3] == (False, "EngineUnreachable")


class GatedKube(MemoryKube):
    """MemoryKube whose pod condition patches land on the listed pods, as the API server's do."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_patches: list[tuple[str, dict[str, Any]]] = []

    def patch_pod_condition(self, namespace: str, name: str, condition: dict[str, Any]) -> None:
        self.gate_patches.append((name, condition))
        pod = next(p for p in self.listed["Pod"] if p["metadata"]["name"] == name)
        others = [c for c in pod["status"]["conditions"] if c["type"] != condition["type"]]
        pod["status"]["conditions"] = [*others, condition]


def kube_with(pods: list[dict[str, Any]]) -> GatedKube:
    kube = GatedKube()
    kube.listed["Pod"] = pods
    return kube


def test_reconcile_writes_adapter_status_condition_and_events() -> None:
    bad = "Loading lora sql failed: No adapter found for /adapters/loras/sql"
    engine = FakeEngine(refuse={"/adapters/loras/sql": bad})
    kube = kube_with([engine_pod("chat-a", "10.0.0.1")])
    reconciler = Reconciler(kube, CONFIG, AdapterSync(Engines(**{"10.0.0.1": engine}).client()))  # type: ignore[arg-type]
    events = reconciler.reconcile(body({"adapters": ADAPTERS}), trigger="create")
    status = kube.statuses[-1]
    assert conditions(status)["AdaptersReady"] == "False/AdapterLoadFailed"
    assert status["adapters"] == [
        {"name": "sql", "source": "pvc://loras/sql", "loadedReplicas": 0, "readyReplicas": 1},
        {"name": "chat", "source": "pvc://loras/chat", "loadedReplicas": 1, "readyReplicas": 1}]
    assert status["replicaAdapters"] == [{"pod": "chat-a", "adapters": ["chat"]}]
    reasons = [(e.type, e.reason) for e in events]
    assert ("Normal", "AdapterLoaded") in reasons and ("Warning", "AdapterLoadFailed") in reasons
    assert bad in next(e.message for e in events if e.reason == "AdapterLoadFailed")
    again = reconciler.reconcile(body({"adapters": ADAPTERS}), trigger="drift")
    assert not [e for e in again if e.type == "Warning"]   # the same failure once, not every retry
    engine.refuse.clear()   # e.g. the files were copied onto the claim
    gate = kube.listed["Pod"][0]["status"]["conditions"][-1]
    assert (gate["type"], gate["status"], gate["reason"]) == ("kubeinfer.io/adapters-loaded", "True", "AdapterLoadFailed")
    assert bad in gate["message"]   # a bad entry must not keep the replica out of service
    healed = reconciler.reconcile(body({"adapters": ADAPTERS}), trigger="drift")
    assert conditions(kube.statuses[-1])["AdaptersReady"] == "True/AdaptersLoaded"
    assert ("Normal", "AdaptersLoaded") in [(e.type, e.reason) for e in healed]


def test_reconcile_without_lora_leaves_engines_alone() -> None:
    engine = FakeEngine()
    kube = kube_with([engine_pod("chat-a", "10.0.0.1")])
    Reconciler(kube, CONFIG, AdapterSync(Engines(**{"10.0.0.1": engine}).client())).reconcile(  # type: ignore[arg-type]
        body({}), trigger="create")
    assert engine.auth == [] and "AdaptersReady" not in conditions(kube.statuses[-1])
    assert kube.statuses[-1]["adapters"] == []


def test_with_api_keys_the_operator_uses_the_admin_port_and_reads_no_secret() -> None:
    """The runtime adapter API is on the engines' admin port, which takes no user's key: spec.auth
    needs no Secret read (the operator holds no `get` on Secrets)."""
    from kubeinfer.server.kube.client import KubeError

    class NoSecrets(GatedKube):
        def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
            if kind == "Secret":
                raise KubeError(403, 'secrets "keys" is forbidden', "Forbidden")
            return super().get(kind, namespace, name)
    engine = FakeEngine()
    kube = NoSecrets()
    kube.listed["Pod"] = [engine_pod("chat-a", "10.0.0.1")]
    spec = {"adapters": ADAPTERS, "auth": {"apiKeySecretRef": {"name": "keys"}}}
    Reconciler(kube, CONFIG, AdapterSync(Engines(**{"10.0.0.1": engine}).client())).reconcile(  # type: ignore[arg-type]
        body(spec), trigger="create")
    assert set(engine.auth) == {None} and engine.ports == {8001} and set(engine.adapters) == {"sql", "chat"}
    assert conditions(kube.statuses[-1])["AdaptersReady"] == "True/AdaptersLoaded"


def test_adapter_edits_leave_the_pod_template_alone() -> None:
    one = deployment(make_isvc({"adapters": ADAPTERS[:1]}), CONFIG)["spec"]["template"]
    two = deployment(make_isvc({"adapters": ADAPTERS}), CONFIG)["spec"]["template"]
    assert one == two
    spec = two["spec"]
    args = spec["containers"][0]["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["KUBEINFER_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    parsed = parsed_args(spec["containers"][0])
    assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank, parsed.lora_modules) == (True, 1, 16, None)
    claims = [v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "loras", "readOnly": True}]
    assert {"mountPath": "/adapters/loras", "readOnly": True} in [
        {k: m.get(k) for k in ("mountPath", "readOnly")} for m in spec["containers"][0]["volumeMounts"]]


def test_lora_is_off_without_adapters_unless_asked() -> None:
    container = lambda spec: deployment(make_isvc(spec), CONFIG)["spec"]["template"]["spec"]["containers"][0]  # noqa: E731
    assert not parsed_args(container({})).enable_lora
    assert "KUBEINFER_ALLOW_RUNTIME_LORA_UPDATING" not in {e["name"] for e in container({})["env"]}
    on = parsed_args(container({"engine": {"lora": {"enabled": True, "maxLoras": 4, "maxLoraRank": 64,
                                                    "maxCpuLoras": 8}}}))
    assert (on.enable_lora, on.max_loras, on.max_lora_rank, on.max_cpu_loras) == (True, 4, 64, 8)


@pytest.mark.parametrize("spec, message", [
    ({"adapters": [ADAPTERS[0], {**ADAPTERS[1], "name": "sql"}]}, "adapter names must be unique; repeated: sql"),
    ({"adapters": [{"name": "x", "source": "hf://org/lora"}]}, "is not an adapter source"),
    ({"adapters": [{"name": "Bad Name", "source": "pvc://a/b"}]}, "should match pattern"),
    ({"model": {"servedName": "sql"}, "adapters": ADAPTERS}, "must differ from model.servedName"),
    ({"engine": {"lora": {"enabled": False}}, "adapters": ADAPTERS}, "engine.lora.enabled is false"),
])
def test_bad_adapter_specs_are_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_isvc(spec)


def test_failure_events_follow_the_condition() -> None:
    from datetime import datetime, timezone

    from kubeinfer.operator.status import Condition
    now = datetime.now(timezone.utc)
    cond = lambda status, reason, message="": Condition(  # noqa: E731
        type="AdaptersReady", status=status, reason=reason, message=message, last_transition_time=now)
    assert transition_events([], [cond("False", "NoReadyReplicas")]) == []   # the expected start
    first = transition_events([cond("False", "NoReadyReplicas")], [cond("False", "AdapterLoadFailed", "x")])
    assert [(e.type, e.reason, e.message) for e in first] == [("Warning", "AdapterLoadFailed", "x")]
    assert transition_events([cond("False", "AdapterLoadFailed", "x")], [cond("False", "AdapterLoadFailed", "x")]) == []
    assert len(transition_events([cond("False", "AdapterLoadFailed", "x")], [cond("False", "AdapterLoadFailed", "y")])) == 1


def test_the_lora_example_builds_against_its_own_claim() -> None:
    from pathlib import Path

    import yaml

    from kubeinfer.operator.children import desired_children
    from kubeinfer.operator.resource import InferenceService
    docs = list(yaml.safe_load_all((Path(__file__).parents[2] / "crds/examples/lora-adapters.yaml").read_text()))
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")["metadata"]["name"]
    manifest = next(d for d in docs if d["kind"] == "InferenceService")
    manifest["metadata"].update(namespace="default", uid="u", generation=1)
    isvc = InferenceService.from_body(manifest)
    assert {a.source.split("/")[2] for a in isvc.spec.adapters} == {claim}
    pod = desired_children(isvc, CONFIG)[0]["spec"]["template"]["spec"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] == [claim]
    copier = next(d for d in docs if d["kind"] == "Pod")["spec"]["securityContext"]
    assert copier["runAsUser"] == pod["securityContext"]["runAsUser"]   # the engines can read what it writes


def test_the_gate_opens_once_the_adapters_are_loaded_and_is_written_once() -> None:
    engine = FakeEngine()
    kube = kube_with([engine_pod("chat-a", "10.0.0.1"), engine_pod("chat-b", "10.0.0.2", ready=False)])
    reconciler = Reconciler(kube, CONFIG, AdapterSync(Engines(**{"10.0.0.1": engine}).client()))  # type: ignore[arg-type]
    reconciler.reconcile(body({"adapters": ADAPTERS}), trigger="pod")
    assert [(name, c["status"], c["reason"]) for name, c in kube.gate_patches] == [("chat-a", "True", "AdaptersLoaded")]
    assert set(engine.adapters) == {"sql", "chat"}   # loaded before the gate opened
    reconciler.reconcile(body({"adapters": ADAPTERS}), trigger="drift")
    assert len(kube.gate_patches) == 1
    template = deployment(make_isvc({"adapters": ADAPTERS}), CONFIG)["spec"]["template"]["spec"]
    assert template["readinessGates"] == [{"conditionType": "kubeinfer.io/adapters-loaded"}]
    assert "readinessGates" not in deployment(make_isvc({}), CONFIG)["spec"]["template"]["spec"]


def test_a_failure_is_logged_once_while_it_repeats_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import REGISTRY
    engine = FakeEngine(refuse={"/adapters/loras/sql": "not a directory"})
    syncer = AdapterSync(Engines(**{"10.0.0.1": engine}).client())
    errors = lambda: REGISTRY.get_sample_value(  # noqa: E731
        "kubeinfer_operator_adapter_operations_total", {"operation": "load", "result": "error"}) or 0.0
    before = errors()
    with caplog.at_level("WARNING", logger="kubeinfer.operator.adapter_sync"):
        for _ in range(3):
            syncer.sync(make_isvc({"adapters": ADAPTERS}), [engine_pod("chat-a", "10.0.0.1")])
    assert len([r for r in caplog.records if "not a directory" in r.getMessage()]) == 1
    assert errors() - before == 3
