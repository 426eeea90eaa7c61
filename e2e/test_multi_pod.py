"""Issue #40 on the local cluster: an InferenceService whose replicas span 2 pods, run by the real
LeaderWorkerSet controller (e2e/localcluster/lws.py, started only for this module).

Each group is a leader pod (`kubeinfer serve`, pipeline stage 0, the API) and a worker pod
(`--headless`, stage 1) of the embedded SmolLM2, joined through LWS's environment. The group is
one replica to the operator, the router, the autoscaler and `kubectl scale`.

The tests share one InferenceService (every group load is this module's cost); each first
scales it to the groups it starts from, so any of them also runs alone. In file order: 1 group
-> `kubectl scale` 2 -> 0 -> 1; the autoscaler 1 -> 2 under load; the chaos test on those 2.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from e2e.localcluster import lws as lws_mod
from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for
from e2e.test_autoscaler import scale_events, served_requests
from e2e.test_routing import gauges, router_sample

pytestmark = pytest.mark.e2e
NAME = "group"
LEADERS = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
WORKERS = f"app.kubernetes.io/component=engine-worker,kubeinfer.io/inferenceservice={NAME}"
ROUTERS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"
LOAD_TIMEOUT = 900   # two pods per group load their stages on a shared 2-core machine
MAX_NUM_SEQS = 4     # per group: more requests than this wait in the leader's queue
UNREADY_SECONDS = 2  # the bound: a group that lost a pod stops being Ready within this
RETRIES = ('kubeinfer:router_retries_total{reason="refused"}', 'kubeinfer:router_retries_total{reason="unanswered"}')


@pytest.fixture(scope="module")
def lws(cluster: Cluster) -> None:
    if not cluster.local:
        pytest.skip("starts LWS on the local cluster (an external one brings its own)")
    lws_mod.start(cluster.config, cluster.kubectl)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, lws: None) -> str:
    cluster.install_chart("operator.driftIntervalSeconds=15")
    return SYSTEM_NS


@pytest.fixture(scope="module")
def service(cluster: Cluster, operator: str) -> Iterator[str]:
    """The namespace of the module's InferenceService (applied at 1 group, not waited for)."""
    namespace = f"e2e-multi-pod-{uuid.uuid4().hex[:5]}"
    cluster.core.create_namespace({"metadata": {"name": namespace, "labels": {"kubeinfer.io/e2e": "true"}}})
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in cluster.core.list_namespaced_service_account(namespace).items),
             f"ServiceAccount {namespace}/default", timeout=30)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(1))
    yield namespace
    cluster.core.delete_namespace(namespace)


def manifest(replicas: int) -> str:
    spec = {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 512},
            "engine": {"device": "cpu", "pipelineParallelSize": 2, "podsPerReplica": 2, "kvCacheMemory": "64Mi",
                       "maxNumSeqs": MAX_NUM_SEQS, "maxNumBatchedTokens": 256},
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": replicas}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def isvc(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "inferenceservice", NAME, "-n", namespace)


def ready_groups(cluster: Cluster, namespace: str, groups: int) -> dict[str, Any] | None:
    status = isvc(cluster, namespace).get("status") or {}
    return status if status.get("replicaSummary") == f"{groups}/{groups}" else None


def scale_to(cluster: Cluster, namespace: str, groups: int) -> None:
    cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas", str(groups))
    wait_for(lambda: ready_groups(cluster, namespace, groups), f"{groups}/{groups} groups Ready",
             timeout=LOAD_TIMEOUT, interval=3)


def router_url(cluster: Cluster, namespace: str) -> str:
    """A Ready router's URL. Bounded like a group's load: in the full suite the router once stayed
    unready past 180 s while its groups were Ready (never alone); a timeout names each router
    pod's phase, conditions and container state, for the next one to read."""
    try:
        pod = wait_for(lambda: next((p for p in cluster.pods(namespace, ROUTERS) if pod_ready(p)), None),
                       "a Ready router pod", timeout=LOAD_TIMEOUT, interval=2)
    except TimeoutError as timeout:
        raise TimeoutError(f"{timeout}\n{cluster.pod_report(namespace, ROUTERS)}") from None
    return f"http://{pod.status.pod_ip}:8080"


def leader_urls(cluster: Cluster, namespace: str) -> dict[str, str]:
    return {p.metadata.name: f"http://{p.status.pod_ip}:8000" for p in cluster.pods(namespace, LEADERS)
            if pod_ready(p) and not p.metadata.deletion_timestamp}


def chat(url: str, max_tokens: int = 8) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_two_pod_replicas_serve_scale_by_groups_and_come_back_from_zero(local_cluster: Cluster, service: str) -> None:
    cluster, namespace = local_cluster, service
    explained = cluster.kubectl("explain", "inferenceservice.spec.engine.podsPerReplica").stdout
    assert "LeaderWorkerSet" in explained, explained
    scale_to(cluster, namespace, 1)
    lws = cluster.kubectl_json("get", "leaderworkerset", NAME, "-n", namespace)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert len(cluster.pods(namespace, LEADERS)) == 1 and len(cluster.pods(namespace, WORKERS)) == 1
    service_object = cluster.kubectl_json("get", "service", NAME, "-n", namespace)
    assert service_object["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"   # the router
    url = router_url(cluster, namespace)
    answer = chat(url)
    assert "Paris" in answer, answer

    scale_to(cluster, namespace, 2)
    assert len(cluster.pods(namespace, LEADERS)) == 2 and len(cluster.pods(namespace, WORKERS)) == 2
    assert cluster.kubectl_json("get", "leaderworkerset", NAME, "-n", namespace)["spec"]["replicas"] == 2
    assert "Paris" in chat(url)

    cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas", "0")
    wait_for(lambda: not cluster.pods(namespace, LEADERS) and not cluster.pods(namespace, WORKERS),
             "every pod of both groups gone", timeout=300, interval=2)
    scale_to(cluster, namespace, 1)
    assert "Paris" in chat(url)


class Load:
    """`clients` threads sending short chat requests through `url` back to back until stopped;
    `failures` lists every answer that was not a 200."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.answered, self.failures = url, [], []
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _client(self) -> None:
        body = {"model": "smollm2", "max_tokens": 16, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Name a city."}]}
        with httpx.Client(timeout=300) as client:
            while not self.halt.is_set():
                try:
                    response = client.post(f"{self.url}/v1/chat/completions", json=body)
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))
                    continue
                if response.status_code == 200:
                    self.answered.append(response.json()["usage"]["completion_tokens"])
                else:
                    self.failures.append(f"{response.status_code}: {response.text[:200]}")

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(timeout=300)


def test_the_autoscaler_adds_a_group_under_load(local_cluster: Cluster, service: str) -> None:
    """Queue depth over the target on the one group's leader: the operator's autoscaler scales
    the InferenceService to 2, LWS adds a whole group, and the new leader takes part of the load."""
    cluster, namespace = local_cluster, service
    scale_to(cluster, namespace, 1)
    before = set(leader_urls(cluster, namespace))
    url = router_url(cluster, namespace)
    autoscaling = {"enabled": True, "metric": "queueDepth", "target": 1, "minReplicas": 1, "maxReplicas": 2,
                   "intervalSeconds": 2, "windowSeconds": 4, "scaleDownDelaySeconds": 3600}
    cluster.kubectl("patch", "inferenceservice", NAME, "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"autoscaling": autoscaling}}))
    try:
        with Load(url, clients=2 * MAX_NUM_SEQS) as load:   # half of them wait in the one leader's queue
            wait_for(lambda: ready_groups(cluster, namespace, 2), "the autoscaler's second group Ready",
                     timeout=LOAD_TIMEOUT, interval=2)
            [added] = set(leader_urls(cluster, namespace)) - before
            wait_for(lambda: served_requests(cluster, namespace).get(added, 0) > 0,
                     f"the added group's leader {added} serving part of the load", timeout=300, interval=2)
    finally:   # the next test starts from these 2 groups without the autoscaler acting on them
        cluster.kubectl("patch", "inferenceservice", NAME, "-n", namespace, "--type=merge",
                        "-p", json.dumps({"spec": {"autoscaling": {"enabled": False}}}))
    events = scale_events(cluster, namespace, NAME)
    assert [reason for _, reason, _ in events] == ["ScaledUp"], events
    assert "queueDepth" in events[0][2] and "1 -> 2" in events[0][2], events[0]
    assert cluster.kubectl_json("get", "leaderworkerset", NAME, "-n", namespace)["spec"]["replicas"] == 2
    assert len(cluster.pods(namespace, WORKERS)) == 2
    assert load.answered and not load.failures, f"requests failed while a group was added: {load.failures}"
    assert set(load.answered) == {16}, "an answer through the router was cut short"


@dataclass
class Answer:
    """One streamed chat answer as the client saw it: the HTTP status and its data events."""

    status: int
    events: list[str]

    @property
    def streamed(self) -> bool:
        """Some of the answer reached the client (a chunk before any error event)."""
        return self.status == 200 and bool(self.events) and not self.events[0].startswith('{"error"')

    @property
    def ending(self) -> str:
        """'error' (an OpenAI error event), the finish_reason, or the HTTP status of a refusal."""
        if self.status != 200:
            return f"HTTP {self.status}: {' '.join(self.events)[:200]}"
        if any(event.startswith('{"error"') for event in self.events):
            return "error"
        reasons = [choice.get("finish_reason") for event in self.events if event != "[DONE]"
                   for choice in json.loads(event).get("choices", [])]
        return next((reason for reason in reversed(reasons) if reason), "none")


async def stream_chat(client: httpx.AsyncClient, url: str, max_tokens: int, progress: list[int], index: int) -> Answer:
    """Stream one chat answer of exactly `max_tokens` tokens; `progress[index]` counts its events."""
    body = {"model": "smollm2", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"Tell me a long story, number {index}."}]}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return Answer(response.status_code, [(await response.aread()).decode(errors="replace")])
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                progress[index] += 1
    return Answer(200, events)


@dataclass
class GroupSample:
    """One look at a group: is its leader Ready (to Kubernetes, or answering /ready), is its worker there."""

    time: float
    group: int
    leader_uid: str
    leader_ready: bool
    worker_running: bool


class GroupWatch(threading.Thread):
    """Samples every group's leader and worker every `interval` seconds until stopped."""

    def __init__(self, cluster: Cluster, namespace: str, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace, self.interval = cluster, namespace, interval
        self.samples: list[GroupSample] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=0.5) as client:
            while not self.halt.wait(self.interval):
                now = time.monotonic()
                pods = {p.metadata.name: p for p in
                        self.cluster.pods(self.namespace, f"kubeinfer.io/inferenceservice={NAME}")}
                for group in (0, 1):
                    leader, worker = pods.get(f"{NAME}-{group}"), pods.get(f"{NAME}-{group}-1")
                    if leader is None:
                        continue
                    running = worker is not None and not worker.metadata.deletion_timestamp and any(
                        status.state.running for status in worker.status.container_statuses or [])
                    ready = not leader.metadata.deletion_timestamp and (
                        pod_ready(leader) or self._answers(client, leader))   # routable, or says it could be
                    self.samples.append(GroupSample(now, group, leader.metadata.uid, ready, running))

    @staticmethod
    def _answers(client: httpx.Client, pod: Any) -> bool:
        if not pod.status.pod_ip:
            return False
        try:
            return client.get(f"http://{pod.status.pod_ip}:8000/ready").status_code == 200
        except httpx.HTTPError:
            return False


def _answers_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _queues(leaders: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(running, waiting) of each leader."""
    running = gauges(leaders, "vllm:num_requests_running")
    waiting = gauges(leaders, "vllm:num_requests_waiting")
    return {name: (running[name], waiting[name]) for name in leaders}


def _retries(router: str) -> float:
    return sum(router_sample(router, sample) for sample in RETRIES)


@dataclass
class Chaos:
    """What the chaos test saw; times in seconds from the worker's deletion."""

    victim: int = -1               # the group whose worker was deleted
    running: float = 0             # its leader's requests streaming at the deletion
    waiting: float = 0             # and waiting in its queue
    deleted: float = 0.0           # time.monotonic() of the deletion
    engine_unready: float = 0.0    # its leader's /ready failed
    pod_unready: float = 0.0       # its leader pod not Ready (or terminating, or gone) in the API
    router_stopped: float = 0.0    # the router no longer picks it (after pod_unready)
    retried: float = 0             # router retries during the test


def test_a_deleted_worker_downs_its_group_and_the_router_retries_what_had_not_started(
        local_cluster: Cluster, service: str) -> None:
    """Chaos on 2 groups: a worker pod deleted while both groups stream answers and more wait in
    the leaders' queues. Each item of #40's chaos clause is its own assertion: the leader unready
    within 2 s; the router no longer sending to it; none lost of the requests that had not started
    streaming (the router retries them on the other group); no half group ever Ready; the group
    recreated and serving again."""
    cluster, namespace = local_cluster, service
    scale_to(cluster, namespace, 2)
    url = router_url(cluster, namespace)
    leaders = leader_urls(cluster, namespace)
    uids = {p.metadata.name: p.metadata.uid for p in cluster.pods(namespace, LEADERS)}
    seen = Chaos(retried=_retries(url))
    watch = GroupWatch(cluster, namespace)
    streams = 3 * MAX_NUM_SEQS   # over 2 groups of MAX_NUM_SEQS: some wait in a queue
    progress = [0] * streams

    def streaming_and_queued() -> tuple[int, float, float] | None:
        """(group, running, waiting) of a leader running MAX_NUM_SEQS with more waiting, once
        every running request has streamed tokens (the router's spread need not be even)."""
        queues = _queues(leaders)
        loads = {group: queues[f"{NAME}-{group}"] for group in (0, 1)}
        if sum(1 for count in progress if count) < sum(running for running, _ in loads.values()):
            return None
        return next(((group, running, waiting) for group, (running, waiting) in loads.items()
                     if running == MAX_NUM_SEQS and waiting >= 1), None)

    async def run() -> tuple[list[Answer], list[Answer]]:
        async with httpx.AsyncClient(timeout=600) as client:
            # 32 tokens: still streaming when the worker goes (deleted once every running one has tokens)
            tasks = [asyncio.create_task(stream_chat(client, url, 32, progress, i)) for i in range(streams)]
            seen.victim, seen.running, seen.waiting = await asyncio.to_thread(
                wait_for, streaming_and_queued, "a leader streaming MAX_NUM_SEQS answers with more queued",
                timeout=LOAD_TIMEOUT, interval=0.2)
            victim_url, victim_uid = leaders[f"{NAME}-{seen.victim}"], uids[f"{NAME}-{seen.victim}"]
            watch.start()
            seen.deleted = time.monotonic()
            await asyncio.to_thread(cluster.core.delete_namespaced_pod, f"{NAME}-{seen.victim}-1", namespace)
            # sent while the group goes down: the router may still pick its leader for these
            later = [asyncio.create_task(stream_chat(client, url, 8, [0] * 4, i)) for i in range(4)]
            await asyncio.to_thread(wait_for, lambda: not _answers_ready(victim_url), "the victim leader unready",
                                    timeout=30, interval=0.05)
            seen.engine_unready = time.monotonic() - seen.deleted

            def unready_to_kubernetes() -> bool:
                pod = next((p for p in cluster.pods(namespace, LEADERS) if p.metadata.uid == victim_uid), None)
                return pod is None or bool(pod.metadata.deletion_timestamp) or not pod_ready(pod)
            await asyncio.to_thread(wait_for, unready_to_kubernetes, "the victim leader's pod unready",
                                    timeout=30, interval=0.05)
            seen.pod_unready = time.monotonic() - seen.deleted

            # The router picks the replica with the fewest requests in flight: the dead leader (none
            # left) over the other group's (all of them) for as long as it lists it, at a retry each.
            def router_skips_victim() -> bool:
                before = _retries(url)
                return httpx.get(f"{url}/v1/models", timeout=30).status_code == 200 and _retries(url) == before
            await asyncio.to_thread(wait_for, router_skips_victim, "the router to stop picking the dead leader",
                                    timeout=30, interval=0.1)
            seen.router_stopped = time.monotonic() - seen.deleted - seen.pod_unready
            try:
                answers = await asyncio.wait_for(asyncio.gather(*tasks, *later), timeout=300)
            except TimeoutError:   # say where they stand (a stalled surviving group was seen with 64-token streams)
                leaders_now = await asyncio.to_thread(leader_urls, cluster, namespace)
                raise AssertionError(f"streams unfinished after 300 s: events per stream {progress}, {seen}, "
                                     f"leaders {await asyncio.to_thread(_queues, leaders_now)}, "
                                     f"router retries {_retries(url):g}") from None
            seen.retried = _retries(url) - seen.retried
            return answers[:streams], answers[streams:]

    answers, later = asyncio.run(run())
    victim_name = f"{NAME}-{seen.victim}"

    def recreated() -> str | None:
        pod = next((p for p in cluster.pods(namespace, LEADERS) if p.metadata.name == victim_name), None)
        ready = pod is not None and pod.metadata.uid != uids[victim_name] and ready_groups(cluster, namespace, 2)
        return f"http://{pod.status.pod_ip}:8000" if ready else None
    try:
        new_leader = wait_for(recreated, f"group {seen.victim} recreated (a new leader) and both groups Ready",
                              timeout=LOAD_TIMEOUT, interval=1)
    finally:
        watch.halt.set()
        watch.join()
    print(f"{seen}; endings {sorted(a.ending for a in answers)}, sent after the deletion "
          f"{[a.ending for a in later]}; {len(watch.samples)} group samples")

    # 1. The leader turns unready within 2 s: its engine (what its readiness probe asks) and its pod.
    assert seen.engine_unready <= UNREADY_SECONDS, \
        f"the leader still answered /ready {seen.engine_unready:.2f} s after its worker was deleted"
    assert seen.pod_unready <= UNREADY_SECONDS, \
        f"the leader pod was still Ready to Kubernetes {seen.pod_unready:.2f} s after its worker was deleted"
    # 2. The router stops sending to it (the wait above): at most 2 s after Kubernetes knew.
    assert seen.router_stopped <= UNREADY_SECONDS, \
        f"the router still picked the dead leader {seen.router_stopped:.2f} s after its pod turned unready"
    # 3. None lost: every request that had not streamed anything when the group went was answered in
    # full (the router retried it on the other group); only streams that had started end in an error.
    lost = [a.ending for a in answers + later if a.ending != "length" and not a.streamed]
    assert not lost, f"{len(lost)} requests that had not started streaming were lost, not retried: {lost}"
    assert seen.retried >= seen.waiting, \
        f"the router retried {seen.retried:g} requests; {seen.waiting:g} were waiting in the lost group's leader"
    broken = [a.ending for a in answers + later if a.ending != "length"]
    assert broken == ["error"] * int(seen.running), \
        f"expected the {seen.running:g} streams of the lost group to end in an error event, the rest in full: {broken}"
    # 4. No half group ever serves: no sample saw a leader Ready (or answering /ready) while its
    # group's worker was gone, but for the lost group's old leader until it turned unready (item 1).
    half = [s for s in watch.samples if s.leader_ready and not s.worker_running
            and not (s.leader_uid == uids[victim_name] and s.time - seen.deleted <= seen.pod_unready)]
    assert watch.samples and not half, f"a leader was Ready while its worker was gone: {half[:5]}"
    # 5. The group is recreated (a new leader: LWS recreates the whole group) and serves again.
    assert "Paris" in chat(new_leader), "the recreated group did not answer"
    assert "Paris" in chat(url)
