"""`kubeinfer bench-kernels` refuses to time anything without a GPU, with a clear message."""

import pytest
import torch

from kubeinfer.server.cli import main

pytestmark = pytest.mark.integration


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_fails_loudly_without_cuda(capsys):
    assert main(["bench-kernels", "--decode-batch", "2"]) == 2
    assert "no CUDA device visible" in capsys.readouterr().err


def test_help_lists_the_workload_knobs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-kernels", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--long-context" in out and "--skip-torch" in out
