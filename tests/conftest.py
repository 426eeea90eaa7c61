"""Make `tests/helpers` importable as `helpers` from every test folder (shared builders), and
refuse a run in which a test has no tier marker, or more than one (`e2e/tiers.py`): `make
test-unit` runs the unit tier, `make test` all of them."""

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))
if str(_TESTS_DIR.parent) not in sys.path:   # e2e/ (tests may import its servers and tiers)
    sys.path.append(str(_TESTS_DIR.parent))

from e2e.tiers import check_tiers  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_tiers(items, _TESTS_DIR)
