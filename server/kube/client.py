"""A small dict-in, dict-out Kubernetes REST client on top of the `kubernetes` package's auth.

Why not the typed APIs: the builders produce plain dicts in the API's own camelCase, and
server-side apply wants exactly that body; round-tripping through generated model classes
would only add a translation that can lose fields.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from kubernetes import client, config

from . import api

COLLECTIONS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "Node": "/api/v1/nodes",  # cluster-scoped: the namespace is ignored
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",  # cluster-scoped
    "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    api.KIND: f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{{ns}}/{api.PLURAL}",
}
TIMEOUT_SECONDS = 30


class KubeError(Exception):
    """A non-2xx answer, carrying the API server's own Status message."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status, self.message, self.reason = status, message, reason


def load_api_client() -> client.ApiClient:
    """In-cluster service account first, then $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client

    def request(self, method: str, path: str, body: Any = None,
                query: Iterable[tuple[str, str]] = (),
                content_type: str = "application/json") -> dict[str, Any] | None:
        """One call; returns the decoded body, None on 404 for GET/DELETE, else raises KubeError."""
        method, url, headers, payload, _ = self.api_client.param_serialize(
            method=method, resource_path=path, query_params=list(query),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body, auth_settings=["BearerToken"])
        response = self.api_client.call_api(method, url, headers, payload,
                                            _request_timeout=TIMEOUT_SECONDS)
        raw = response.read() or b"{}"
        if response.status == 404 and method in ("GET", "DELETE"):
            return None  # also the API server's plain-text 404 for a kind whose CRD is not installed
        try:
            data = json.loads(raw) if raw.strip() else {}
        except ValueError:  # not a Status object (a proxy's or the mux's plain-text answer)
            data = {"message": raw[:500].decode(errors="replace")}
        if response.status >= 300:
            raise KubeError(response.status, data.get("message", str(raw[:500])),
                            data.get("reason", ""))
        return data

    def path(self, kind: str, namespace: str, name: str | None = None) -> str:
        base = COLLECTIONS[kind].format(ns=namespace)
        return f"{base}/{name}" if name else base

    def apply(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Server-side apply as the operator's field manager; force takes fields back on drift."""
        meta = obj["metadata"]
        return self.request("PATCH", self.path(obj["kind"], meta["namespace"], meta["name"]), obj,
                            query=[("fieldManager", api.FIELD_MANAGER), ("force", "true")],
                            content_type="application/apply-patch+yaml")

    def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists (False then); its answer is not read back."""
        meta = obj["metadata"]
        try:
            self.request("POST", self.path(obj["kind"], meta["namespace"]), obj)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.request("GET", self.path(kind, namespace, name))

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        found = self.request("GET", self.path(kind, namespace), query=[("labelSelector", selector)])
        return (found or {}).get("items", [])

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.request("DELETE", self.path(kind, namespace, name))

    def label(self, kind: str, namespace: str, name: str, labels: dict[str, str | None]) -> None:
        """Merge-patch labels onto an object (a node's model-cache label); None removes one."""
        self.request("PATCH", self.path(kind, namespace, name), {"metadata": {"labels": labels}},
                     content_type="application/merge-patch+json")

    def delete_with_dependents(self, kind: str, namespace: str, name: str) -> None:
        """Delete in the background, its pods with it (a Job's own default orphans them)."""
        self.request("DELETE", self.path(kind, namespace, name), {"propagationPolicy": "Background"})

    def patch_pod_condition(self, namespace: str, name: str, condition: dict[str, Any]) -> None:
        """Set one pod condition (a readiness gate); strategic merge keeps the kubelet's."""
        self.request("PATCH", self.path("Pod", namespace, name) + "/status",
                     {"status": {"conditions": [condition]}},
                     content_type="application/strategic-merge-patch+json")

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource: fields we do not send stay as they are."""
        self.request("PATCH", self.path(api.KIND, namespace, name) + "/status",
                     {"status": status}, content_type="application/merge-patch+json")
