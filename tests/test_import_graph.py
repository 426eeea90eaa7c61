"""The product's import graph, read from the source (issue 38): no module imports its way back to
itself, the operator, the autoscaler and the router keep to their layers, neither the
operator nor the router can reach torch, and the server reaches the kernels only through their op
modules.

Imports inside functions count: a cycle closed by a lazy import is still a cycle. Imports under
`if TYPE_CHECKING:` do not (they never run). The type-only circles left, each an annotation naming
a class of the module that builds or holds it:
  sequence -> pooler, detokenizer (Sequence.pooling_task, .detokenizer);
  model/registry -> config (ModelConfig in the builders' signature);
  model/layers/linear -> model/adapters/lora_layers (Linear.lora, set by LoRA's wrapping).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"server": "kubeinfer.server", "kernels": "kubeinfer.kernels", "operator": "kubeinfer.operator"}
FORBIDDEN_IN_CONTROL_PLANE = {"torch", "triton"}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """kubeinfer module name -> (file, is a package's __init__)."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package, *(parts[:-1] if is_package else parts)])] = (path, is_package)
    return found


@cache
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(our modules each module imports at run time, third-party top-level packages it imports)."""
    ours, theirs = {}, {}
    known = modules()
    for name, (path, is_package) in known.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree)
        here = name.split(".") if is_package else name.split(".")[:-1]
        ours[name], theirs[name] = set(), set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                if not target.startswith("kubeinfer."):
                    theirs[name].add(target.split(".")[0])
                    continue
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    ours[name].add(target)
    return ours, theirs


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_its_way_back_to_itself() -> None:
    found = cycles(graph()[0])
    assert not found, "import cycles (a lazy import inside a function counts):\n" + \
        "\n".join(" <-> ".join(component) for component in found)


def layer(module: str) -> str | None:
    """The control-plane layers: kube (the shared leaf), router, autoscaler, operator (its
    `main`, which wires everything together, is the composition root above them all)."""
    for prefix, name in (("kubeinfer.server.kube", "kube"), ("kubeinfer.server.router.flags", "router flags"),
                         ("kubeinfer.server.router", "router"), ("kubeinfer.operator.autoscaler", "autoscaler"),
                         ("kubeinfer.operator.main", "operator main"), ("kubeinfer.operator", "operator")):
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None


# What each layer may import of the others; each reads its own package freely.
MAY_IMPORT = {
    "kube": set(),
    "router flags": set(),
    "router": {"kube", "router flags"},
    "autoscaler": {"kube"},
    "operator": {"kube", "router flags"},   # it renders the router's Deployment; it never runs it
    "operator main": {"kube", "router flags", "autoscaler", "operator"},
}


def test_the_operator_the_autoscaler_and_the_router_keep_to_their_layers() -> None:
    offenders = [f"{module} -> {target}"
                 for module, targets in graph()[0].items() if (source := layer(module))
                 for target in sorted(targets) if (wanted := layer(target))
                 and wanted != source and wanted not in MAY_IMPORT[source]]
    assert not offenders, "imports across the control plane's layers:\n" + "\n".join(offenders)
    assert not {target for module, targets in graph()[0].items() if layer(module) == "kube"
                for target in targets if layer(target) != "kube"}, "server/kube/ must import nothing of ours"


def test_the_operator_and_the_router_cannot_reach_torch() -> None:
    """Follows every import (lazy ones too) from every module of the operator, the autoscaler and
    the router; names the path to the first module that imports torch or triton."""
    ours, theirs = graph()
    starts = sorted(m for m in ours if layer(m))
    parent: dict[str, str | None] = dict.fromkeys(starts)
    queue = deque(starts)
    while queue:
        module = queue.popleft()
        if theirs[module] & FORBIDDEN_IN_CONTROL_PLANE:
            path = [module]
            while parent[path[-1]] is not None:
                path.append(parent[path[-1]])
            raise AssertionError(f"{' -> '.join(reversed(path))} imports "
                                 f"{sorted(theirs[module] & FORBIDDEN_IN_CONTROL_PLANE)}")
        for target in sorted(ours[module]):
            if target not in parent:
                parent[target] = module
                queue.append(target)


# The kernels' API (issue 38): the device-generic ops and the CPU kernels' named API. The Triton
# and C kernel modules and the torch references behind them are theirs to import, never the server's.
KERNEL_OPS = ("kubeinfer.kernels", "kubeinfer.kernels.ops", "kubeinfer.kernels.ops_cpu")


def test_the_server_reaches_the_kernels_only_through_the_op_modules() -> None:
    ours = graph()[0]
    offenders = [f"{module} -> {target}" for module, targets in sorted(ours.items())
                 if module.startswith("kubeinfer.server.") for target in sorted(targets)
                 if target.startswith("kubeinfer.kernels") and target not in KERNEL_OPS]
    assert not offenders, ("server modules importing kernel modules past " + ", ".join(KERNEL_OPS[1:]) + ":\n"
                           + "\n".join(offenders))


def test_the_entry_points_load_without_torch() -> None:
    """What actually runs: the operator's and the router's entry points, imported in a fresh
    interpreter (the static check above sees only our own modules' imports)."""
    code = ("import sys\n"
            "import kubeinfer.operator.main, kubeinfer.operator.crd, kubeinfer.server.router.cli\n"
            "from kubeinfer.server import cli\n"
            "cli._build_parser(['route'])\n"
            "heavy = sorted({'torch', 'triton'} & set(sys.modules))\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
