"""The local cluster stands on its own: the e2e tests, `make demo` and the benchmarks build on it,
never the other way round, and it needs nothing of the product but the exit-code leaf a pod reads."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1]
ALLOWED_PRODUCT = {"kubeinfer.server.exit_codes"}


def absolute_imports(path: Path) -> set[str]:
    """Every absolute import of a module, those inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_local_cluster_imports_nothing_else_of_e2e_or_the_product() -> None:
    offenders = {f"{path.relative_to(PACKAGE)}: {name}"
                 for path in PACKAGE.glob("*.py") for name in absolute_imports(path)
                 if (name.split(".")[0] == "e2e" and not name.startswith("e2e.localcluster"))
                 or (name.split(".")[0] == "kubeinfer" and name not in ALLOWED_PRODUCT)}
    assert not offenders, sorted(offenders)
