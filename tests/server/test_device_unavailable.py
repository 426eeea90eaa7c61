"""`kubeinfer serve --device cuda` where there is no CUDA: one clear line, the termination
message Kubernetes shows, and the exit code the operator turns into a DeviceUnavailable condition."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from kubeinfer.server import exit_codes
from kubeinfer.server.api import serve

pytestmark = pytest.mark.unit


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_exits_with_its_code_and_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    termination_log = tmp_path / "termination-log"
    termination_log.touch()   # the kubelet mounts it empty
    monkeypatch.setattr(exit_codes, "TERMINATION_LOG", str(termination_log))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--device", "cuda", "--port", "0"])
    with caplog.at_level(logging.ERROR, logger="kubeinfer.serve"):
        assert serve.run(args) == exit_codes.DEVICE_UNAVAILABLE
    message = termination_log.read_text()
    assert message.startswith("device 'cuda' requested but CUDA is not available (")
    assert message.endswith("use device 'cpu' or 'auto'") and "\n" not in message
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [message]
