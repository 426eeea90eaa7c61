"""`python -m e2e.demo` keeps working: its stages run against the session cluster, and a stage
that gives up says why. (The cluster stage itself is not rerun: the demo claims the cluster it
brings up, which a test session must not do.)"""

from __future__ import annotations

import re

import pytest

from e2e import demo
from e2e.helpers import TEST_RELEASE_DESCRIPTION, Cluster


@pytest.mark.unit
def test_a_failing_stage_carries_its_diagnostics() -> None:
    def never_ready() -> tuple[bool, str]:
        return False, "Ready=False ReplicasNotReady: 0/1 replicas ready"

    with pytest.raises(demo.StageFailed) as failed:
        with demo.stage(3, "model", diagnose=lambda: "describe output"):
            demo.wait_reporting(never_ready, "default/smollm2 Ready", timeout=0.1)
    assert "stage 3/5 (model) failed" in str(failed.value)
    assert "not reached after 0 s (last: Ready=False ReplicasNotReady: 0/1 replicas ready)" in str(failed.value)
    assert failed.value.details == "describe output"


@pytest.mark.e2e
def test_demo_stages_serve_and_explain_the_embedded_model(local_cluster: Cluster, namespace: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    demo.install_chart(local_cluster, "--description", TEST_RELEASE_DESCRIPTION)
    isvc = demo.apply_example(local_cluster, namespace, timeout=600)
    base, model = demo.chat(local_cluster, isvc, "Say hello.")
    demo.next_steps(local_cluster.config, isvc, base, model)
    out = capsys.readouterr().out
    assert re.search(r"^smollm2 +True +1/1 +embedded +SmolLM2-135M-Instruct +1 ", out, re.M), out
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base) and model == "SmolLM2-135M-Instruct"
    assert re.search(r"^      < \S", out, re.M), out  # a non-empty answer was printed
    assert f"curl -s {base}/chat/completions" in out and f"kubectl get kis -n {namespace}" in out
    assert f"kubectl logs -n {namespace} deploy/smollm2" in out and 'make -s' in out
