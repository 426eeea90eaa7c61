"""Build the pinned control-plane binaries from the Go module proxy, cached outside the repo.

Why: these machines have no container runtime, so kube-apiserver & co. run as plain processes.
Each component is built once into ``<cache>/bin/<name>-<version>/`` and rebuilt only when its pin
changes. ``python -m e2e.binaries`` builds everything; cold, on 2 busy cores, this took ~42 min
(kubernetes alone 38 min), so CI machines should keep ``~/.cache/kubeinfer/bin`` between runs.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
ETCD_MAIN = """package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


@dataclass(frozen=True)
class Pins:
    """One version per component. kubectl here is 1.32, so the control plane is 1.33 (skew +1)."""

    kubernetes: str = "v1.33.13"
    etcd: str = "v3.6.16"
    kwok: str = "v0.8.0"
    helm: str = "v3.22.0"


PINS = Pins()
COMMANDS = {
    "kubernetes": ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
    "etcd": ("etcd",),
    "kwok": ("kwok", "kwokctl"),
    "helm": ("helm",),
}


def bin_dir(component: str, pins: Pins = PINS) -> Path:
    return CACHE / "bin" / f"{component}-{getattr(pins, component)}"


def binary(name: str, pins: Pins = PINS) -> Path:
    component = next(c for c, names in COMMANDS.items() if name in names)
    return bin_dir(component, pins) / name


def _go(args: list[str], cwd: Path, log, env: dict[str, str] | None = None) -> dict:
    """Run one go command with static, trimmed, 2-job settings; its output goes to the log."""
    full_env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath -buildvcs=false", **(env or {})}
    log.write(f"$ go {' '.join(args)}  (in {cwd})\n")
    log.flush()
    out = subprocess.run(["go", *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=log, text=True)
    log.write(out.stdout)
    if out.returncode:
        raise RuntimeError(f"go {args[0]} failed; see {log.name}")
    return json.loads(out.stdout) if args[:2] == ["mod", "download"] else {}


def _module(path: str, version: str, log) -> dict:
    return _go(["mod", "download", "-json", f"{path}@{version}"], CACHE, log)


def _kubernetes_go_mod(version: str, info: dict) -> str:
    """Wrapper go.mod: require k8s.io/kubernetes and replace each staging module by its release.

    The replace lines come from the release's own go.mod (``k8s.io/x => ./staging/src/k8s.io/x``),
    so the list is never typed by hand; staging modules are published as v0.<minor>.<patch>.
    """
    upstream = Path(info["GoMod"]).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/src/", upstream, re.M)
    go_line = re.search(r"^go .*$", upstream, re.M).group(0)
    godebug = re.findall(r"^godebug .*$", upstream, re.M)
    published = "v0." + version.removeprefix("v1.")
    lines = ["module kubeinfer.local/kubernetes-wrapper", "", go_line, *godebug, "",
             f"require k8s.io/kubernetes {version}", "", "replace ("]
    lines += [f"\t{name} => {name} {published}" for name in staging] + [")", ""]
    return "\n".join(lines)


def _kubernetes_ldflags(version: str, info: dict) -> str:
    """The ldflags hack/lib/version.sh sets, so /version reports the real release."""
    major, minor = version.removeprefix("v").split(".")[:2]
    commit = info.get("Origin", {}).get("Hash", "")
    stamp = json.loads(Path(info["Info"]).read_text())["Time"].split(".")[0].removesuffix("Z") + "Z"
    values = dict(gitVersion=version, gitMajor=major, gitMinor=minor, gitCommit=commit,
                  gitTreeState="clean", buildDate=stamp)
    flags = [f"-X {pkg}.{k}={v}" for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
             for k, v in values.items()]
    return "-s -w " + " ".join(flags)


def _build_kubernetes(version: str, out: Path, work: Path, log) -> None:
    info = _module("k8s.io/kubernetes", version, log)
    (work / "go.mod").write_text(_kubernetes_go_mod(version, info))
    pkgs = [f"k8s.io/kubernetes/cmd/{name}" for name in COMMANDS["kubernetes"]]
    _go(["build", "-mod=mod", "-p", "2", "-ldflags", _kubernetes_ldflags(version, info), "-o", str(out) + "/", *pkgs],
        work, log)


def _build_etcd(version: str, out: Path, work: Path, log) -> None:
    """etcd's server module has relative replaces, so build its etcdmain from a wrapper main."""
    go_mod = f"module kubeinfer.local/etcd-wrapper\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 {version}\n"
    (work / "go.mod").write_text(go_mod)
    (work / "main.go").write_text(ETCD_MAIN)
    _go(["mod", "tidy"], work, log)
    _go(["build", "-p", "2", "-ldflags", "-s -w", "-o", str(out / "etcd"), "."], work, log)


def _install(pkgs: list[str], ldflags: str, out: Path, work: Path, log) -> None:
    _go(["install", "-p", "2", "-ldflags", ldflags, *pkgs], work, log, env={"GOBIN": str(out)})


def _build_kwok(version: str, out: Path, work: Path, log) -> None:
    ldflags = f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={version}"
    _install([f"sigs.k8s.io/kwok/cmd/{n}@{version}" for n in COMMANDS["kwok"]], ldflags, out, work, log)


def _build_helm(version: str, out: Path, work: Path, log) -> None:
    ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={version}"
    _install([f"helm.sh/helm/v3/cmd/helm@{version}"], ldflags, out, work, log)


BUILDERS = {"etcd": _build_etcd, "kwok": _build_kwok, "helm": _build_helm, "kubernetes": _build_kubernetes}


def ensure(component: str, pins: Pins = PINS) -> Path:
    """Build one component unless its pinned binaries are already cached; returns its bin dir."""
    out = bin_dir(component, pins)
    stamp = out / ".built"
    if stamp.exists():
        return out
    version = getattr(pins, component)
    work = CACHE / "build" / f"{component}-{version}"
    work.parent.mkdir(parents=True, exist_ok=True)
    with open(work.parent / f"{work.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building it right now
        if not stamp.exists():
            _build(component, version, out, work, stamp)
    return out


def _build(component: str, version: str, out: Path, work: Path, stamp: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"building {component} {version} (log: {work}.log)", file=sys.stderr, flush=True)
    with open(f"{work}.log", "w") as log:
        BUILDERS[component](version, out, work, log)
    missing = [n for n in COMMANDS[component] if not (out / n).exists()]
    if missing:
        raise RuntimeError(f"{component} {version}: build produced no {missing}")
    stamp.write_text(json.dumps({"version": version, "seconds": round(time.monotonic() - start)}) + "\n")


def ensure_all(pins: Pins = PINS) -> dict[str, Path]:
    return {component: ensure(component, pins) for component in BUILDERS}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(BUILDERS):
        t0 = time.monotonic()
        print(f"{name}: {ensure(name)} ({time.monotonic() - t0:.0f} s)", flush=True)
