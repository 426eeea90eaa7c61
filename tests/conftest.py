"""Make `tests/helpers` importable as `helpers` from every test folder (shared builders), and
mark the tests that run the embedded 30-layer model against transformers or across TP processes
`slow`: `make test-unit` (`-m "not slow"`) leaves them out, `make test` runs them."""

import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# Named here rather than in the files so the parity suites themselves stay as they are.
SLOW = (
    "tests/engine/test_parity.py::test_smollm2_matches_transformers",
    "tests/model/test_gguf_parity.py::test_logits_match_transformers_prefill_chunks_and_decode",
    "tests/parallel/test_tp_parity.py::test_embedded_model_tp3_matches_tp1",
    "tests/parallel/test_serve_tp.py::test_tp3_serves_the_openai_client_on_the_embedded_model",
    "tests/parallel/test_serve_tp.py::test_killing_a_worker_fails_health_and_exits_non_zero",
    "tests/parallel/test_multinode.py::test_embedded_model_pp2_across_two_processes_matches_one",
    "tests/engine/test_kv_cache_fp8.py::test_fp8_logits_close_to_float32_cache_teacher_forced",
    "tests/engine/test_kv_cache_fp8.py::test_prefix_cache_and_chunked_prefill_read_the_fp8_cache",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        node = f"{Path(str(item.path)).relative_to(root).as_posix()}::{item.name}"
        if any(node.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)
