"""The product image, checked without a container runtime.

`test_image_install_steps_give_a_working_kubeinfer` runs the Dockerfile's own install script
(docker/install.sh) into a clean virtualenv: every pinned dependency of docker/requirements.txt
from the package index (pip's cache makes reruns quick), kubeinfer built from this tree, `pip
check`, then the installed `kubeinfer` generates with the embedded model and its operator and
router load. Only torch is borrowed, from the environment the tests run in: the same release
docker/torch.txt pins (asserted), whose multi-GB wheels the image takes from the variant's index.
What it does not prove: the base images, the torch index, the USER/ENV lines at run time.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TORCH_INDEX_WHEELS = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def _pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _torch_site(target: Path) -> Path:
    """A directory holding (as links) only torch and the wheels its index brings with it."""
    target.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        dist = metadata.distribution(todo.pop())
        for entry in {Path(str(file)).parts[0] for file in dist.files or []}:
            source = Path(str(dist.locate_file(entry)))
            if source.exists() and not (target / entry).exists() and not entry.startswith(".."):
                (target / entry).symlink_to(source)
        for text in dist.requires or []:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            if TORCH_INDEX_WHEELS.match(name) and name not in seen and (
                    requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                seen.add(name)
                todo.append(name)
    return target


@pytest.mark.unit
def test_the_pins_are_what_the_tests_run_with() -> None:
    """docker/lock.py wrote them from this environment; a dependency upgraded since (or a new one)
    must be locked again, or the image would ship what no test ran. The image serves the tracing
    extra too: an InferenceService's spec.tracing turns the OTLP exporter on in its pods."""
    assert _pinned(ROOT / "docker/torch.txt")["torch"] == metadata.version("torch").split("+")[0]
    pins = _pinned(ROOT / "docker/requirements.txt")
    for requirement in map(Requirement, metadata.distribution("kubeinfer").requires or []):
        name = canonicalize_name(requirement.name)
        marker = str(requirement.marker or "")
        if ("extra" not in marker or '"tracing"' in marker) and not TORCH_INDEX_WHEELS.match(name):
            assert name in pins and requirement.specifier.contains(pins[name]), (name, pins.get(name))


@pytest.mark.unit
def test_the_dockerfile_runs_the_install_script_as_non_root_with_a_writable_tmp() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "bash /src/docker/install.sh /src" in dockerfile
    assert re.search(r"^USER 65532:65532$", dockerfile, re.M)   # the operator's runAsUser
    for variable in ("HOME=/tmp", "TMPDIR=/tmp", "KUBEINFER_CACHE_DIR=/tmp/kubeinfer", "TRITON_CACHE_DIR=/tmp/"):
        assert variable in dockerfile   # a read-only root writes only in the pods' /tmp emptyDir


@pytest.mark.unit
def test_the_charts_default_image_is_what_make_image_builds() -> None:
    import yaml

    from kubeinfer.operator.main import default_engine_image

    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    chart = yaml.safe_load((ROOT / "helm/kubeinfer/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm/kubeinfer/values.yaml").read_text())
    made = subprocess.run(["make", "-s", "-n", "image"], cwd=ROOT, capture_output=True, text=True).stdout
    built = re.search(r"-t (\S+) \.", made)[1]
    assert built == f"{values['image']['repository']}:{chart['appVersion']}" == default_engine_image()
    assert chart["appVersion"] == version and values["image"]["tag"] == "" and values["engineImage"] == ""


@pytest.mark.unit
def test_make_image_says_what_is_missing_without_a_builder(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "bash", "sed", "make"):   # everything the recipe needs but a builder
        found = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        (bare / tool).symlink_to(found)
    result = subprocess.run(["make", "-s", "image"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PATH": str(bare)})
    assert result.returncode != 0
    assert "no container builder found: install Docker, Podman or Buildah" in result.stderr


@pytest.mark.integration
def test_image_install_steps_give_a_working_kubeinfer(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "borrowed.pth").write_text(f"{_torch_site(tmp_path / 'torch-site')}\n")
    env = {**os.environ, "KUBEINFER_TORCH": "present", "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}",
           "VIRTUAL_ENV": str(env_dir)}
    env.pop("PYTHONPATH", None)
    subprocess.run([str(python), "-m", "ensurepip", "--default-pip"], check=True, capture_output=True, env=env)
    install = subprocess.run(["bash", str(ROOT / "docker/install.sh"), str(ROOT)], env=env,
                             capture_output=True, text=True, timeout=1500)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], env=env,
                               capture_output=True, text=True, check=True).stdout
    versions = dict(line.split("==") for line in installed.splitlines() if "==" in line)
    pins = _pinned(ROOT / "docker/requirements.txt")
    assert {canonicalize_name(k): v for k, v in versions.items() if canonicalize_name(k) in pins} == pins
    kubeinfer = env_dir / "bin" / "kubeinfer"
    answer = subprocess.run([str(kubeinfer), "generate", "--max-tokens", "3", "--temperature", "0",
                             "--device", "cpu", "Say hi."], env={**env, "KUBEINFER_CACHE_DIR": str(tmp_path / "cache")},
                            capture_output=True, text=True, timeout=600)
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr[-3000:]
    loads = subprocess.run([str(python), "-c", "import kubeinfer.operator.main, kubeinfer.server.router.cli, "
                            "kubeinfer.server.api.app, kubeinfer.server.otel as otel; "
                            "otel.make_tracer('http://127.0.0.1:4318/v1/traces', 1.0, 'image'); "
                            "print(kubeinfer.server.api.app.__file__)"],
                           env=env, capture_output=True, text=True, check=True).stdout
    assert loads.startswith(site)   # the installed copy, not this tree
