"""A tenant's `keys_file` in the tenant file (server/tenancy.py): read as `--api-keys-file` is,
relative to the tenant file's directory, its keys checked with the table's; an unreadable,
empty or inconsistent one stops `kubeinfer serve` / `kubeinfer route` at startup with a
message that names the file and never a key."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kubeinfer.server.credentials import CredentialFiles
from kubeinfer.server.tenancy import TenantResolver, load_tenants

pytestmark = pytest.mark.unit


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_keys_file_adds_its_keys_relative_to_the_tenant_file(tmp_path: Path) -> None:
    write(tmp_path / "keys" / "team-a", "\n  sk-a-1  \n# rotated next week\nsk-a-2,sk-a-3\n\n")
    absolute = write(tmp_path / "elsewhere" / "b", "sk-b-1\n")
    table = load_tenants(write(tmp_path / "tenants.yaml", f"""
tenants:
  - {{name: team-a, keys: [sk-a-0], keys_file: keys/team-a, priority: 2}}
  - {{name: team-b, keys_file: {absolute}}}
"""))
    tenants = table.by_name()
    assert tenants["team-a"].keys == ["sk-a-0", "sk-a-1", "sk-a-2", "sk-a-3"]
    assert tenants["team-b"].keys == ["sk-b-1"]
    resolver = TenantResolver(table, trust_header=False)
    assert resolver.identify(resolver.keys().index("sk-a-3"), {}).name == "team-a"
    assert resolver.identify(resolver.keys().index("sk-b-1"), {}).name == "team-b"


@pytest.mark.parametrize("tenants, files, message", [
    ("- {name: a, keys_file: keys/missing}", {},
     r"tenants\.0: keys_file .*keys/missing: cannot read it \(FileNotFoundError\)"),
    ("- {name: a, keys_file: keys/a}", {"keys/a": "\n# nothing yet\n"}, r"keys_file .*keys/a holds no API key"),
    ("- {name: a, keys_file: keys/a}\n- {name: b, keys_file: keys/b}",
     {"keys/a": "sk-secret-1\nsk-secret-2", "keys/b": "sk-secret-2"}, "an API key belongs to two tenants"),
    ("- {name: a, keys: [sk-secret-1], keys_file: keys/a}", {"keys/a": "sk-secret-1"},
     "an API key belongs to two tenants"),
    ("- {name: a, keys_file: keys/a}", {"keys/a": b"sk-secret-\xff\xfe"}, r"cannot read it \(UnicodeDecodeError\)"),
    ("- {name: a, keys_file: ''}", {}, "keys_file"),
])
def test_bad_keys_files_stop_startup_without_showing_a_key(
        tmp_path: Path, tenants: str, files: dict[str, str | bytes], message: str) -> None:
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = argparse.Namespace(tenants_file=str(write(tmp_path / "tenants.yaml", f"tenants:\n{tenants}\n")),
                              api_keys=[], api_keys_file=None, require_api_key=False,
                              key_reload_seconds=0)
    with pytest.raises(SystemExit) as stopped:
        CredentialFiles.from_args(args)
    text = str(stopped.value)
    assert text.startswith("--tenants-file ")
    assert re.search(message, text), text
    assert "sk-secret" not in text


def test_an_unreadable_keys_file_names_only_the_file(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()   # a directory where the file should be
    with pytest.raises(ValueError, match="cannot read it") as refused:
        load_tenants(write(tmp_path / "t.json", '{"tenants": [{"name": "a", "keys_file": "keys"}]}'))
    assert str(tmp_path / "keys") in str(refused.value)
