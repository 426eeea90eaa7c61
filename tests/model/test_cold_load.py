"""Cold-start guards: building the model skips init and stays off torch's compiler stack, and the
serve path never imports transformers (issue #4: spawn to first token under 5 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from kubeinfer.server.model.loader import uninitialized_modules

pytestmark = pytest.mark.integration

_SLOW_MODULES = ("torch._dynamo", "sympy", "transformers")


def test_modules_are_built_on_the_device_in_the_dtype_without_init():
    default = torch.get_default_dtype()
    with uninitialized_modules(torch.device("cpu"), torch.bfloat16):
        layer = nn.Linear(8, 4)
        marker = torch.full((3,), 7.0)
        assert nn.init.normal_(marker) is marker
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.device.type == "cpu"
    assert marker.tolist() == [7.0, 7.0, 7.0]   # init was a no-op
    assert torch.get_default_dtype() == default


def test_default_dtype_is_restored_when_building_fails():
    default = torch.get_default_dtype()
    try:
        with uninitialized_modules(torch.device("cpu"), torch.bfloat16):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.get_default_dtype() == default


def test_loading_the_embedded_model_imports_no_compiler_and_no_transformers():
    """torch._dynamo alone costs ~2 s of import; the meta-device build used to pull it in."""
    code = ("import json, sys\n"
            "import kubeinfer.server.api.serve, kubeinfer.server.api.app\n"
            "from kubeinfer.server.model.loader import load_model\n"
            "load_model('embedded', device='cpu')\n"
            f"print(json.dumps([m for m in {_SLOW_MODULES!r} if m in sys.modules]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
