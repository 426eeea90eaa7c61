"""Run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is imported (triton.language defines its own
helpers with `@jit` at import) and before our kernels are defined. Once they are, the
setting is pinned in `triton.knobs` and the variable is removed from the environment again
(unless the caller set it), so servers and CLIs that other test folders start as
subprocesses do not inherit it. Other folders run the torch path on this CPU anyway.
"""

import importlib
import os

import pytest

_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET on purpose)
from triton.runtime.jit import JITFunction  # noqa: E402

KERNEL_MODULES = ["unified_attention", "split_kv_attention", "kv_cache", "rms_norm", "rotary", "activation", "moe"]
for _name in KERNEL_MODULES:
    _module = importlib.import_module(f"kubeinfer.kernels.{_name}")
    if any(isinstance(getattr(obj, "fn", obj), JITFunction) for obj in vars(_module).values()):
        raise pytest.UsageError(f"kubeinfer.kernels.{_name} was imported (compiled, not interpreted) before "
                                "tests/kernels/conftest.py ran; import Triton kernel modules lazily")

triton.knobs.runtime.interpret = os.environ["TRITON_INTERPRET"] == "1"
if _SET_HERE:
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture
def triton_backend():
    """Force the Triton path of `kubeinfer.kernels.ops` (interpreted on this CPU)."""
    from kubeinfer.kernels import ops

    with ops.use_backend("triton"):
        yield
