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
import torch  # noqa: E402

KERNEL_MODULES = ["unified_attention", "split_kv_attention", "kv_cache", "rms_norm", "rotary", "activation", "moe", "w4a16",
                  "lora"]
for _name in KERNEL_MODULES:
    _module = importlib.import_module(f"kubeinfer.kernels.triton.{_name}")
    if any(isinstance(getattr(obj, "fn", obj), JITFunction) for obj in vars(_module).values()):
        raise pytest.UsageError(f"kubeinfer.kernels.triton.{_name} was imported (compiled, not interpreted) before "
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


# --- CPU kernel build variants (kernels/cpu/cpu_build.py ISAS): each CPU-kernel test runs once per
# variant its module (or its `cpu_isas` mark) names, so the paths CPUs without AMX or AVX-512
# take are tested here too. A variant is skipped only for an instruction set this CPU lacks; the
# summary says which variants ran.
from kubeinfer.kernels.cpu import cpu_build  # noqa: E402

_COVERED: dict[str, dict[str, int]] = {}  # variant -> outcome -> tests
_SKIPPED: dict[str, str] = {}  # variant -> why


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_isas(*variants): the KUBEINFER_CPU_ISA builds a test runs under")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cpu_isa" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("cpu_isas")
    metafunc.parametrize("cpu_isa", mark.args if mark else tuple(cpu_build.ISAS), indirect=True)


@pytest.fixture
def two_threads():
    """Torch's (and so the C kernels' OpenMP) thread count pinned at 2, how CI machines run: the
    CPU kernels split work differently by thread count (decode: whole sequences from 8 on)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cpu_isa(request: pytest.FixtureRequest):
    """This test's kernels built for one variant (KUBEINFER_CPU_ISA)."""
    name = request.param
    missing = cpu_build.missing_cpu_flags(name)
    if missing:
        pytest.skip(f"the {name} kernels need {', '.join(missing)}, which this CPU lacks")
    with cpu_build.forced_isa(name):
        yield name


@pytest.fixture
def amx() -> None:
    """Skip, naming what is missing, where this process cannot run AMX tiles."""
    from kubeinfer.kernels.cpu import quant_linear_cpu

    if quant_linear_cpu.amx_available():
        return
    lacks = [f for f in ("amx_tile", "amx_bf16") if f not in set(cpu_build._cpu_flags().split())]
    pytest.skip(f"needs {', '.join(lacks)}, which this CPU lacks" if lacks else
                "needs AMX, which Linux did not grant this process (arch_prctl XCOMP_PERM)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    variant = _variant(report.nodeid)
    if variant is None or (report.when != "call" and not report.skipped):
        return
    counts = _COVERED.setdefault(variant, {})
    counts[report.outcome] = counts.get(report.outcome, 0) + 1
    if report.skipped and isinstance(report.longrepr, tuple):
        _SKIPPED.setdefault(variant, report.longrepr[2].removeprefix("Skipped: "))


def _variant(nodeid: str) -> str | None:
    params = nodeid.rpartition("[")[2].rstrip("]").split("-") if nodeid.endswith("]") else []
    return next((p for p in params if p in cpu_build.ISAS), None)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _COVERED:
        return
    terminalreporter.write_sep("-", "CPU kernel paths covered (KUBEINFER_CPU_ISA variants)")
    for variant in cpu_build.ISAS:
        counts = _COVERED.get(variant, {})
        ran = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "not run"
        why = f" ({_SKIPPED[variant]})" if variant in _SKIPPED else ""
        terminalreporter.write_line(f"{variant:>7}: {ran}{why}")
