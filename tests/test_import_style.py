"""One import style (issue 26): inside a folder package (server/, kernels/, operator/) modules
import each other relatively; only other folders are named as `kubeinfer.<folder>`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("folder", ["server", "kernels", "operator"])
def test_a_folder_imports_itself_relatively(folder: str) -> None:
    own = re.compile(rf"^\s*(from|import) kubeinfer\.{folder}\b", re.M)
    offenders = [f"{path.relative_to(REPO)}:{text[:match.start()].count(chr(10)) + 1}"
                 for path in sorted((REPO / folder).rglob("*.py"))
                 for text in [path.read_text()] for match in own.finditer(text)]
    assert not offenders, f"import these relatively: {offenders}"
