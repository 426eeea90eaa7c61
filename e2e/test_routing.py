"""The cache-aware router on the local cluster (issue #19): 3 real engine pods, 2 router pods.

The issue's workload: 8 tenants, each with its own system prompt of over 1,024 tokens, 16 chat
requests each (128), concurrency 16, sent alternately through both router pods (the local
cluster has no kube-proxy, so the test talks to pod IPs, as the Service would). Asserted: the
engines' reported cached prompt tokens are >= 85% of a single replica's for the same workload
(run afterwards against one engine pod directly, with its own cache_salt); no engine serves
more than 1.5x the mean of the routed requests; both routers send the same request to the same
engine; and with the deletion costs the operator sets, scaling 3 -> 2 removes the engine whose
cache served least (one of them, when two served equally). Scaling 2 -> 3, the routers warm the
new engine with the tenants' system prompts. The chart runs with `networkPolicy.enabled`: the
service's NetworkPolicy is checked as far as a cluster without a network plugin can.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest

from e2e.helpers import SYSTEM_NS, Cluster, pod_ready, wait_for

pytestmark = pytest.mark.e2e
NAME = "routed"
ENGINES = f"app.kubernetes.io/component=engine,kubeinfer.io/inferenceservice={NAME}"
ROUTERS = f"app.kubernetes.io/component=gateway,kubeinfer.io/inferenceservice={NAME}"
COST = "controller.kubernetes.io/pod-deletion-cost"
TENANTS, PER_TENANT, CONCURRENCY = 8, 16, 16
RULES = 34   # 30 tokens each: a system prompt of 1,033 tokens, 1,047 with the question
PROMPT_TOKENS = 1024
ROUTER_POLL_SECONDS = 0.5      # the routers' --poll-interval default (digests)
ROUTER_METRICS_SECONDS = 2.0   # 4 x that (the engines' gauges)
SETTLE_SECONDS = 15            # kubeinfer:prefix_cache_hits_recent's wall-clock tick (server/engine/stats.py)
TOPICS = ["garden tools", "train tickets", "tax forms", "pet food", "guitar strings", "bike repair",
          "tea leaves", "phone plans"]


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> str:
    cluster.install_chart("operator.driftIntervalSeconds=15", "networkPolicy.enabled=true")
    return SYSTEM_NS


def manifest(replicas: int) -> str:
    # KV for every tenant's prompt on one engine (8 x 1,047 tokens at 22.5 KiB, ~185 MiB), so
    # the single-replica reference keeps them all
    spec = {"model": {"source": "embedded", "servedName": "smollm2", "maxModelLen": 2048},
            "engine": {"device": "cpu", "kvCacheMemory": "384Mi", "maxNumSeqs": 16,
                       "maxNumBatchedTokens": 1024},
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": replicas,
            "routing": {"strategy": "prefix-aware"}}
    return json.dumps({"apiVersion": "kubeinfer.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME}, "spec": spec})


def ready_urls(cluster: Cluster, namespace: str, selector: str, port: int, count: int) -> dict[str, str]:
    def found() -> dict[str, str] | None:
        pods = [p for p in cluster.pods(namespace, selector) if pod_ready(p) and not p.metadata.deletion_timestamp]
        return {p.metadata.name: f"http://{p.status.pod_ip}:{port}" for p in pods} if len(pods) == count else None

    try:
        return wait_for(found, f"{count} Ready pods {selector}", timeout=900, interval=2)
    except TimeoutError as timeout:
        raise TimeoutError(f"{timeout}\n{cluster.pod_report(namespace, selector)}") from None


def system_prompt(tenant: int) -> str:
    topic = TOPICS[tenant]
    rules = " ".join(f"Rule {i}: when a customer asks about {topic}, answer in one short sentence, "
                     f"cite the {topic} catalogue and never discuss anything else." for i in range(RULES))
    return f"Tenant {tenant}. You are the support assistant for {topic}. {rules}"


def body(tenant: int, question: int | str, salt: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system_prompt(tenant)},
                         {"role": "user", "content": f"Question {question}: what do you recommend?"}],
            "max_tokens": 2, "temperature": 0, "cache_salt": salt}


async def workload(urls: list[str], salt: str, per_tenant: int = PER_TENANT) -> int:
    """Cached prompt tokens of the whole run; request i goes to urls[i % len(urls)]."""
    bodies = [body(t, q, salt) for q in range(per_tenant) for t in range(TENANTS)]
    slots = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(index: int, request: dict) -> int:
            async with slots:
                response = await client.post(f"{urls[index % len(urls)]}/v1/chat/completions", json=request)
                assert response.status_code == 200, response.text
                usage = response.json()["usage"]
                assert usage["prompt_tokens"] > PROMPT_TOKENS, usage
                return usage["prompt_tokens_details"]["cached_tokens"]

        return sum(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))


def gauges(engines: dict[str, str], *names: str) -> dict[str, float]:
    """Per engine pod: the sum of the named metrics over their label sets."""
    def count(url: str) -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.split("{", 1)[0].split(" ", 1)[0] in names)
    return {name: count(url) for name, url in engines.items()}


def served(engines: dict[str, str]) -> dict[str, float]:
    return gauges(engines, "vllm:request_success_total")


def routers_ready_for_keys(routers: list[str]) -> None:
    """Each router has learned the engines' tokenizer: a probe request is routed by its key
    (the routers are probed side by side)."""
    def ready(index: int, url: str) -> None:
        def keyed() -> bool:
            httpx.post(f"{url}/v1/chat/completions", json=body(0, f"probe {time.time()}", f"probe-{index}"),
                       timeout=600)
            text = httpx.get(f"{url}/metrics", timeout=10).text
            return 'reason="affinity"' in text or 'reason="prefix"' in text
        wait_for(keyed, f"router {url} routing by key", timeout=120, interval=2)

    with ThreadPoolExecutor(len(routers)) as pool:
        list(pool.map(ready, range(len(routers)), routers))


def label_query(selector: dict[str, Any]) -> str:
    """A LabelSelector as `kubectl -l` takes it (matchLabels, and `In` expressions)."""
    terms = [f"{key}={value}" for key, value in (selector.get("matchLabels") or {}).items()]
    for expression in selector.get("matchExpressions") or []:
        assert expression["operator"] == "In", expression
        terms.append(f"{expression['key']} in ({','.join(expression['values'])})")
    return ",".join(terms)


def assert_network_policy(cluster: Cluster, namespace: str, engines: dict[str, str], routers: dict[str, str]) -> None:
    """The API server accepted the operator's policy (an owned child of the InferenceService), and
    its selectors, evaluated by the API server against the running pods, guard exactly the engine
    pods and admit exactly this service's engines and routers and the operator's pod, on no other
    rule (a router fronts the engines: no client reaches them directly). Whether packets are then
    dropped is the network plugin's part; the local cluster has none (docs/security.md)."""
    policy = cluster.kubectl_json("get", "networkpolicy", NAME, "-n", namespace)
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    spec = policy["spec"]

    def pods(selector: dict[str, Any], where: str = namespace) -> set[str]:
        return {p.metadata.name for p in cluster.pods(where, label_query(selector)) if not p.metadata.deletion_timestamp}

    assert pods(spec["podSelector"]) == set(engines)
    [rule] = spec["ingress"]
    assert "ports" not in rule and spec["policyTypes"] == ["Ingress"]
    admitted: set[str] = set()
    for peer in rule["from"]:
        if "namespaceSelector" in peer:
            names = cluster.kubectl("get", "namespaces", "-l", label_query(peer["namespaceSelector"]), "-o", "name").stdout.split()
            assert names == [f"namespace/{SYSTEM_NS}"], names
            operator_pods = pods(peer["podSelector"], SYSTEM_NS)
            assert operator_pods and all(name.startswith("kubeinfer-") for name in operator_pods), operator_pods
        else:
            admitted |= pods(peer["podSelector"])
    assert admitted == set(engines) | set(routers)


def test_prefix_aware_routing_on_the_cluster(local_cluster: Cluster, operator: str, namespace: str) -> None:
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(3))
    engines = ready_urls(local_cluster, namespace, ENGINES, 8000, 3)
    router_pods = ready_urls(local_cluster, namespace, ROUTERS, 8080, 2)
    assert_network_policy(local_cluster, namespace, engines, router_pods)
    routers = list(router_pods.values())
    routers_ready_for_keys(routers)

    before = served(engines)
    routed = asyncio.run(workload(routers, "routed"))
    after = served(engines)
    counts = [after[name] - before[name] for name in engines]
    # the same workload on one engine, in a cache namespace of its own (after the routed run:
    # its load would otherwise steer the routers' first choices for a few seconds)
    single = asyncio.run(workload([next(iter(engines.values()))], "single-replica"))
    print(f"cached prompt tokens: single replica {single}, routed {routed}; requests per engine {counts}")
    assert routed >= 0.85 * single
    assert max(counts) <= 1.5 * sum(counts) / len(counts)

    wait_for(lambda: not any(gauges(engines, "vllm:num_requests_running", "vllm:num_requests_waiting").values()),
             "every engine idle", timeout=120, interval=0.5)
    # The routers learn the idle gauges by scraping each engine every 4 x --poll-interval (2 s):
    # two such periods after the engines went idle, both have (no router exposes its view).
    time.sleep(2 * ROUTER_METRICS_SECONDS)
    chosen: list[list[list[str]]] = [[] for _ in range(TENANTS)]   # per tenant, per router
    for index, router in enumerate(routers):
        if index:
            # the other router reads the blocks the first one's requests stored at its next
            # digest poll (every --poll-interval, 0.5 s): two polls
            time.sleep(2 * ROUTER_POLL_SECONDS)
        for tenant in range(TENANTS):
            start = served(engines)
            response = httpx.post(f"{router}/v1/chat/completions", json=body(tenant, "same", "routed"), timeout=600)
            assert response.status_code == 200
            end = served(engines)
            chosen[tenant].append([name for name in engines if end[name] > start[name]])
    for picks in chosen:
        assert picks[0] == picks[1] and len(picks[0]) == 1, chosen

    # The engines credit cache hits at the next 15 s wall-clock boundary after they happen; a cost
    # the operator wrote after that boundary holds all of this traffic and from then on only
    # decays, alike on every pod, so the order the ReplicaSet sees is the one read here. (Costs
    # written earlier can miss the last requests: seen to swap two engines 2,000 tokens apart.)
    settled = datetime.fromtimestamp((time.time() // SETTLE_SECONDS + 1) * SETTLE_SECONDS + 1, timezone.utc)

    def written_at(pod: Any) -> datetime | None:
        """When the pod's deletion cost was last changed (its managed-fields entry)."""
        return max((entry.time for entry in pod.metadata.managed_fields or []
                    if f"f:{COST}" in ((entry.fields_v1 or {}).get("f:metadata") or {}).get("f:annotations", {})),
                   default=None)

    def costs() -> dict[str, int] | None:
        """Every engine pod's cost, once written after `settled`."""
        pods = [p for p in local_cluster.pods(namespace, ENGINES) if not p.metadata.deletion_timestamp]
        final = [p for p in pods if (when := written_at(p)) is not None and when >= settled]
        if len(final) != 3:
            return None
        values = {p.metadata.name: int(p.metadata.annotations[COST]) for p in final}
        return values if max(values.values()) > 0 else None

    cost = wait_for(costs, "deletion costs of all this traffic on every engine pod", timeout=120, interval=2)
    # the operator wrote them: the routers' own identity may read pods, never write one
    router = f"--as=system:serviceaccount:{namespace}:{NAME}-gateway"
    can = {verb: local_cluster.kubectl("auth", "can-i", verb, "pods", "-n", namespace, router, check=False).stdout.strip()
           for verb in ("list", "patch", "update", "delete")}
    assert can == {"list": "yes", "patch": "no", "update": "no", "delete": "no"}, can
    # tenants land whole on engines, so two engines may have served exactly as many cached
    # tokens: either of them is "the coldest" then, but the hottest must never be chosen
    coldest = {name for name, value in cost.items() if value == min(cost.values())}
    assert len(coldest) < len(cost), cost
    local_cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas=2")

    def remaining() -> set[str] | None:
        names = {p.metadata.name for p in local_cluster.pods(namespace, ENGINES) if not p.metadata.deletion_timestamp}
        return names if len(names) == 2 else None

    kept = wait_for(remaining, "one engine removed", timeout=180, interval=2)
    removed = set(cost) - kept
    print(f"deletion costs {cost}; removed {removed}")
    assert len(removed) == 1 and removed <= coldest, (cost, removed)


def router_sample(url: str, sample: str) -> float:
    """One sample (name and labels as exposed) of a router's metrics; 0 before it exists."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_scaled_up_engine_is_warmed_by_the_routers(local_cluster: Cluster, operator: str, namespace: str) -> None:
    """Scale 2 -> 3: the routers send the new engine pod the tenants' shared system prompts
    before it is asked for them, so its first request of each tenant finds the prompt cached."""
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(2))
    before = ready_urls(local_cluster, namespace, ENGINES, 8000, 2)
    routers = list(ready_urls(local_cluster, namespace, ROUTERS, 8080, 2).values())
    routers_ready_for_keys(routers)
    asyncio.run(workload(routers, "warm", per_tenant=4))   # each router sees every tenant twice: shared prefixes

    local_cluster.kubectl("scale", "inferenceservice", NAME, "-n", namespace, "--replicas=3")
    engines = ready_urls(local_cluster, namespace, ENGINES, 8000, 3)
    [new] = [url for name, url in engines.items() if name not in before]
    outcomes = ('kubeinfer:router_warmup_requests_total{outcome="sent"}',
                'kubeinfer:router_warmup_requests_total{outcome="cached"}')

    def warmed() -> float | None:   # the routers sent every tenant's prefix, or found it there
        done = sum(router_sample(url, sample) for url in routers for sample in outcomes)
        return done if done >= TENANTS else None   # (the workload sends each tenant to one router)

    wait_for(warmed, "the routers warmed the new engine", timeout=300, interval=2)
    sent = sum(router_sample(url, outcomes[0]) for url in routers)
    cached = []
    for tenant in range(TENANTS):   # straight to the new pod: what its cache holds
        answer = httpx.post(f"{new}/v1/chat/completions", json=body(tenant, "first on the new engine", "warm"),
                            timeout=600)
        assert answer.status_code == 200, answer.text
        cached.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    print(f"warm-up requests sent by the routers: {sent:g}; cached prompt tokens of each tenant's first "
          f"request on the new engine: {cached}")
    assert all(tokens > 0 for tokens in cached), cached
    assert sent <= 2 * TENANTS


async def stream(url: str, request: dict, started: asyncio.Event | None = None) -> list[str]:
    """The data lines of one streamed answer (ends by itself: the router never leaves it hanging);
    `started` is set at its first token."""
    events = []
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", f"{url}/v1/chat/completions", json={**request, "stream": True}) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if started is not None:
                        started.set()
    return events


def ending(answer: list[str]) -> str:
    """How a stream ended: 'error' (an OpenAI error event), else its finish_reason."""
    if any(event.startswith('{"error"') for event in answer[:-1]):
        return "error"
    reasons = [choice.get("finish_reason") for event in answer[:-1] for choice in json.loads(event).get("choices", [])]
    return next((reason for reason in reversed(reasons) if reason), "none")


def test_engine_and_router_pods_going_away(local_cluster: Cluster, operator: str, namespace: str) -> None:
    """Chaos: an engine pod killed mid-run, then a router pod."""
    local_cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(3))
    engines = ready_urls(local_cluster, namespace, ENGINES, 8000, 3)
    routers = ready_urls(local_cluster, namespace, ROUTERS, 8080, 2)
    first, second = list(routers.values())
    routers_ready_for_keys([first, second])

    async def run() -> tuple[list[list[str]], list[int], float]:
        long = [{**body(t, "long", "chaos"), "max_tokens": 256, "ignore_eos": True} for t in range(6)]
        started = [asyncio.Event() for _ in long]
        streams = [asyncio.create_task(stream(first, request, flag)) for request, flag in zip(long, started)]
        await asyncio.wait_for(asyncio.gather(*(flag.wait() for flag in started)), timeout=600)
        # every stream has its first token: the victim is the engine running the most of them
        running = await asyncio.to_thread(gauges, engines, "vllm:num_requests_running")
        victim = max(running, key=running.__getitem__)
        local_cluster.kubectl("delete", "pod", victim, "-n", namespace, "--grace-period=0", "--force")
        async with httpx.AsyncClient(timeout=300) as client:   # requests not yet started go elsewhere
            later = await asyncio.gather(*(client.post(f"{first}/v1/chat/completions", json=body(t, "after", "chaos"))
                                           for t in range(TENANTS)))
        answers = await asyncio.wait_for(asyncio.gather(*streams), timeout=900)
        return answers, [r.status_code for r in later], running[victim]

    events, later, on_victim = asyncio.run(run())
    assert later == [200] * TENANTS
    for answer in events:
        assert answer[-1] == "[DONE]"
        # a stream cut short ends with an OpenAI error event: the draining engine's own (503), or
        # the router's when the pod went away mid-answer (502)
        broken = [json.loads(e)["error"] for e in answer[:-1] if e.startswith('{"error"')]
        assert all(error["message"] and error["type"] for error in broken)
    endings = [ending(answer) for answer in events]
    print(f"streams: {len(events)}, in flight on the deleted engine: {on_victim:g}, endings: {endings}")
    # 256 tokens each: the deleted engine's streams were still running when it went; each of them
    # ends with an error event, every other stream runs to its length
    assert on_victim >= 1
    assert sorted(endings) == sorted(["error"] * int(on_victim) + ["length"] * (len(events) - int(on_victim)))
    local_cluster.kubectl("delete", "pod", next(iter(routers)), "-n", namespace, "--grace-period=0", "--force")
    answer = httpx.post(f"{second}/v1/chat/completions", json=body(1, "survivor", "chaos"), timeout=600)
    assert answer.status_code == 200
