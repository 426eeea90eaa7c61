"""Every kernel and autotune config compiles to a cubin for Ampere and Hopper, without a GPU.

The interpreter never applies compiled-mode rules (constexpr-only globals, dtype checks,
shared-memory limits), so this runs `kubeinfer.kernels.tools.compile_check` in a subprocess with
TRITON_INTERPRET unset.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _compile_check(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "kubeinfer.kernels.tools.compile_check", *args],
                          capture_output=True, text=True, env=env, timeout=900)


def test_every_kernel_and_config_compiles_for_hopper_bf16():
    result = _compile_check("--arch", "90", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok    sm_90 bfloat16") == 49 and "0 failure(s)" in result.stdout


def test_every_kernel_and_config_compiles_for_ampere_and_hopper_in_both_dtypes():
    result = _compile_check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok    sm_") == 192   # 2 x 49 on Hopper, 2 x 47 on Ampere (no fp8 e4m3)


def test_refuses_to_run_under_the_interpreter():
    result = _compile_check("--arch", "90", interpret=True)
    assert result.returncode == 2 and "unset TRITON_INTERPRET" in result.stderr
