"""`spec.adapters` → the LoRA adapters every Ready engine holds, through vLLM's runtime API.

The adapter list is not part of the pod template (editing it must not restart pods), so each
reconcile compares, pod by pod, what the engine reports (`GET /v1/models`: adapters are the
entries with a `parent`, their `root` is the path they were loaded from) with what the spec
asks for, and closes the gap with `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`.
Reading the engine every time, instead of remembering what was sent, is what makes it
idempotent and what re-loads a pod whose engine restarted (runtime loads die with it) or a
pod created later. This module decides (`plan`) and turns a sync's outcome into status, the AdaptersReady
condition and Events, all pure; `adapter_sync.AdapterSync` talks to the engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from . import api
from .events import Event
from .resource import InferenceService
from .status import AdapterStatus, ReplicaAdapters

MAX_MESSAGE = 1000


@dataclass(frozen=True)
class Action:
    kind: Literal["load", "unload"]
    name: str
    path: str | None = None  # lora_path, for loads


def plan(desired: Mapping[str, str], held: Mapping[str, str | None]) -> list[Action]:
    """Unloads first (they free slots), then loads. `held` maps each adapter the engine reports
    to the path it came from (None when the engine does not say); an adapter whose source
    moved is unloaded and loaded again from the new path. Adapters the operator cannot have
    loaded (a path outside the volumes it mounts, e.g. `--lora-modules` in engine.extraArgs
    pointing into the image) are the user's: left alone."""
    moved = {name for name, root in held.items()
             if name in desired and root is not None and root != desired[name]}
    unloads = [Action("unload", name) for name in sorted(held)
               if name in moved or (name not in desired and ours(held[name]))]
    loads = [Action("load", name, desired[name]) for name in sorted(desired)
             if name not in held or name in moved]
    return unloads + loads


def ours(root: str | None) -> bool:
    """Whether an adapter loaded from `root` may come from spec.adapters (see model_source)."""
    return root is None or any(root.startswith(mount + "/") for mount in (api.ADAPTER_MOUNT, api.MODEL_MOUNT))


def engine_adapters(models: Mapping[str, Any]) -> dict[str, str | None]:
    """The adapters in a `/v1/models` answer: vLLM lists each with `parent` = the base model."""
    return {card["id"]: card.get("root") for card in models.get("data") or []
            if isinstance(card, dict) and card.get("parent")}


@dataclass
class PodAdapters:
    """One Ready engine pod after a sync: what it holds, what failed, what was done."""

    pod: str
    held: set[str] = field(default_factory=set)
    failures: dict[str, str] = field(default_factory=dict)  # adapter -> the engine's error
    done: list[Action] = field(default_factory=list)
    unreachable: str | None = None  # why its adapters could not be read


@dataclass(frozen=True)
class AdapterReport:
    """Every Ready engine pod's adapters after a sync (pods in name order)."""

    pods: list[PodAdapters]


def serving(pod: Mapping[str, Any]) -> bool:
    """The engine answers: its containers are ready. Not the pod's Ready, which waits for the
    adapters gate (`api.ADAPTERS_GATE`) that the operator sets after loading them."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("ContainersReady", "Ready") and c.get("status") == "True" for c in conditions)


def gate_conditions(pods: list[dict[str, Any]], report: AdapterReport) -> dict[str, dict[str, Any]]:
    """Pod name → the adapters gate condition to write, for synced pods whose gate says
    otherwise. The gate opens once every load was tried, also when one failed: a bad adapter
    entry must not keep new replicas (a rollout, a scale-up) out of service; AdaptersReady
    reports the failure."""
    current = {pod["metadata"]["name"]: next((c for c in (pod.get("status") or {}).get("conditions") or []
                                              if c.get("type") == api.ADAPTERS_GATE), {}) for pod in pods}
    wanted = {}
    for pod in report.pods:
        if pod.unreachable is not None:
            continue
        reason = "AdapterLoadFailed" if pod.failures else "AdaptersLoaded"
        old = current.get(pod.pod, {})
        if old.get("status") != "True" or old.get("reason") != reason:
            message = "; ".join(f"{name}: {error}" for name, error in pod.failures.items())[:MAX_MESSAGE]
            wanted[pod.pod] = {"type": api.ADAPTERS_GATE, "status": "True", "reason": reason,
                               "message": message or f"{len(pod.held)} adapters loaded"}
    return wanted


def adapter_condition(isvc: InferenceService, report: AdapterReport | None) -> tuple[str, bool, str, str]:
    """(type, status, reason, message) of AdaptersReady: every Ready replica holds every adapter."""
    wanted = [a.name for a in isvc.spec.adapters]
    if report is None or not report.pods:
        return ("AdaptersReady", not wanted, "NoReadyReplicas" if wanted else "NoAdapters",
                f"{len(wanted)} adapters wait for a Ready replica" if wanted else "no adapters declared")
    failures = [f"adapter {name} in pod {pod.pod}: {message}"
                for pod in report.pods for name, message in pod.failures.items()]
    if failures:
        return ("AdaptersReady", False, "AdapterLoadFailed", "; ".join(failures)[:MAX_MESSAGE])
    unreachable = [f"pod {pod.pod}: {pod.unreachable}" for pod in report.pods if pod.unreachable]
    if unreachable:
        return ("AdaptersReady", False, "EngineUnreachable", "; ".join(unreachable)[:MAX_MESSAGE])
    missing = sorted({n for pod in report.pods for n in wanted if n not in pod.held})
    if missing:  # not reached: a failure or an unreachable pod explains every gap
        return ("AdaptersReady", False, "AdaptersLoading", f"not loaded yet: {', '.join(missing)}")
    return ("AdaptersReady", True, "AdaptersLoaded",
            f"{len(wanted)} adapters in all {len(report.pods)} Ready replicas" if wanted else "no adapters declared")


def adapter_status(isvc: InferenceService, report: AdapterReport | None) -> dict[str, Any]:
    """status.adapters (per adapter: how many Ready replicas hold it) and status.replicaAdapters."""
    pods = report.pods if report else []
    known = [p for p in pods if p.unreachable is None]
    return {
        "adapters": [AdapterStatus(name=a.name, source=a.source, ready_replicas=len(pods),
                                   loaded_replicas=sum(a.name in p.held for p in known))
                     for a in isvc.spec.adapters],
        "replica_adapters": [ReplicaAdapters(pod=p.pod, adapters=sorted(p.held)) for p in known],
    }


def action_events(report: AdapterReport | None) -> list[Event]:
    """One Normal Event per adapter loaded or unloaded, naming the pods (failures surface as
    the AdaptersReady condition's Warning instead, once, not on every retry)."""
    pods_by: dict[tuple[str, str], list[str]] = {}
    for pod in report.pods if report else []:
        for action in pod.done:
            pods_by.setdefault((action.kind, action.name), []).append(pod.pod)
    reasons: dict[str, Callable[[str, list[str]], Event]] = {
        "load": lambda n, p: Event("Normal", "AdapterLoaded", f"loaded adapter {n} into {', '.join(p)}"),
        "unload": lambda n, p: Event("Normal", "AdapterUnloaded", f"unloaded adapter {n} from {', '.join(p)}")}
    return [reasons[kind](name, pods) for (kind, name), pods in pods_by.items()]
