"""The dict REST client speaks server-side apply and surfaces the API server's own messages."""

from __future__ import annotations

import pytest
from fake_apiserver import Recorder, kube  # noqa: F401  (kube is a fixture)

from kubeinfer.server.kube.client import Kube, KubeError

pytestmark = pytest.mark.unit


def test_apply_is_server_side_apply_with_our_field_manager(kube: Kube) -> None:  # noqa: F811
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "chat", "namespace": "team-a"}, "spec": {"type": "ClusterIP"}}
    kube.apply(service)
    sent = Recorder.seen[-1]
    assert sent["method"] == "PATCH"
    assert sent["path"] == "/api/v1/namespaces/team-a/services/chat?fieldManager=kubeinfer-operator&force=true"
    assert sent["content_type"] == "application/apply-patch+yaml" and sent["body"] == service


def test_missing_objects_read_as_none(kube: Kube) -> None:  # noqa: F811
    Recorder.answers["/apis/apps/v1/namespaces/team-a/deployments/chat"] = (404, {"reason": "NotFound"})
    assert kube.get("Deployment", "team-a", "chat") is None
    kube.delete("Deployment", "team-a", "chat")  # deleting what is gone is fine


def test_plain_text_answers_of_the_api_server(kube: Kube) -> None:  # noqa: F811
    """A kind whose CRD is not installed answers a plain-text 404: gone, not a crash; other
    plain-text refusals keep their text."""
    path = "/apis/inference.networking.k8s.io/v1/namespaces/team-a/inferencepools/chat"
    Recorder.answers[path] = (404, b"404 page not found\n")
    assert kube.request("DELETE", path) is None
    Recorder.answers[path] = (503, b"upstream connect error")
    with pytest.raises(KubeError, match="upstream connect error"):
        kube.request("GET", path)


def test_refusals_carry_the_api_message(kube: Kube) -> None:  # noqa: F811
    path = "/apis/policy/v1/namespaces/team-a/poddisruptionbudgets/chat"
    Recorder.answers[path] = (422, {"kind": "Status", "reason": "Invalid",
                                    "message": 'PodDisruptionBudget "chat" is invalid'})
    with pytest.raises(KubeError) as refused:
        kube.apply({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": "chat", "namespace": "team-a"}})
    assert (refused.value.status, refused.value.reason) == (422, "Invalid")
    assert refused.value.message == 'PodDisruptionBudget "chat" is invalid'


def test_status_is_a_merge_patch_of_the_status_subresource(kube: Kube) -> None:  # noqa: F811
    kube.patch_status("team-a", "chat", {"readyReplicas": 1})
    sent = Recorder.seen[-1]
    assert sent["path"] == "/apis/kubeinfer.io/v1alpha1/namespaces/team-a/inferenceservices/chat/status"
    assert sent["content_type"] == "application/merge-patch+json"
    assert sent["body"] == {"status": {"readyReplicas": 1}}


def test_list_passes_the_label_selector(kube: Kube) -> None:  # noqa: F811
    Recorder.answers["/api/v1/namespaces/team-a/pods"] = (200, {"items": [{"metadata": {"name": "p"}}]})
    assert kube.list("Pod", "team-a", "a=b,c=d") == [{"metadata": {"name": "p"}}]
    assert Recorder.seen[-1]["path"] == "/api/v1/namespaces/team-a/pods?labelSelector=a%3Db%2Cc%3Dd"
