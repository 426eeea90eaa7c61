"""The dict REST client speaks server-side apply and surfaces the API server's own messages.

A loopback HTTP server stands in for the API server and records what it was sent.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Iterator

import pytest
from kubernetes import client

from kubeinfer.operator.kube import Kube, KubeError


class Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []
    answers: dict[str, tuple[int, dict[str, Any]]] = {}

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append({"method": self.command, "path": self.path, "body": body,
                          "content_type": self.headers.get("Content-Type")})
        code, payload = self.answers.get(self.path.split("?")[0], (200, body or {}))
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_DELETE = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def kube() -> Iterator[Kube]:
    server = HTTPServer(("127.0.0.1", 0), Recorder)
    Recorder.seen, Recorder.answers = [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    yield Kube(client.ApiClient(config))
    server.shutdown()


def test_apply_is_server_side_apply_with_our_field_manager(kube: Kube) -> None:
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "chat", "namespace": "team-a"}, "spec": {"type": "ClusterIP"}}
    kube.apply(service)
    sent = Recorder.seen[-1]
    assert sent["method"] == "PATCH"
    assert sent["path"] == "/api/v1/namespaces/team-a/services/chat?fieldManager=kubeinfer-operator&force=true"
    assert sent["content_type"] == "application/apply-patch+yaml" and sent["body"] == service


def test_missing_objects_read_as_none(kube: Kube) -> None:
    Recorder.answers["/apis/apps/v1/namespaces/team-a/deployments/chat"] = (404, {"reason": "NotFound"})
    assert kube.get("Deployment", "team-a", "chat") is None
    kube.delete("Deployment", "team-a", "chat")  # deleting what is gone is fine


def test_refusals_carry_the_api_message(kube: Kube) -> None:
    path = "/apis/policy/v1/namespaces/team-a/poddisruptionbudgets/chat"
    Recorder.answers[path] = (422, {"kind": "Status", "reason": "Invalid",
                                    "message": 'PodDisruptionBudget "chat" is invalid'})
    with pytest.raises(KubeError) as refused:
        kube.apply({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": "chat", "namespace": "team-a"}})
    assert (refused.value.status, refused.value.reason) == (422, "Invalid")
    assert refused.value.message == 'PodDisruptionBudget "chat" is invalid'


def test_status_is_a_merge_patch_of_the_status_subresource(kube: Kube) -> None:
    kube.patch_status("team-a", "chat", {"readyReplicas": 1})
    sent = Recorder.seen[-1]
    assert sent["path"] == "/apis/kubeinfer.io/v1alpha1/namespaces/team-a/inferenceservices/chat/status"
    assert sent["content_type"] == "application/merge-patch+json"
    assert sent["body"] == {"status": {"readyReplicas": 1}}


def test_list_passes_the_label_selector(kube: Kube) -> None:
    Recorder.answers["/api/v1/namespaces/team-a/pods"] = (200, {"items": [{"metadata": {"name": "p"}}]})
    assert kube.list("Pod", "team-a", "a=b,c=d") == [{"metadata": {"name": "p"}}]
    assert Recorder.seen[-1]["path"] == "/api/v1/namespaces/team-a/pods?labelSelector=a%3Db%2Cc%3Dd"
