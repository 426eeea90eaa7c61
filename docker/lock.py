"""Writes the image's pins from the running environment (the project venv the tests ran in):
docker/requirements.txt, every runtime dependency of kubeinfer and of its extras the image serves
(IMAGE_EXTRAS: an InferenceService's spec.tracing turns on the OTLP exporter in the engine pod)
but torch's own CUDA/Triton wheels (the variant's torch index brings those), and docker/torch.txt,
the torch release.

    python docker/lock.py
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Installed with torch from the variant's index (docker/install.sh), not pinned here.
FROM_TORCH_INDEX = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
IMAGE_EXTRAS = ("tracing",)


def closure(root: str, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """Name -> version of `root`'s runtime dependencies and those of its `extras` on this platform,
    recursively (no extras of the dependencies)."""
    found: dict[str, str] = {}
    todo = [root]
    while todo:
        dist = todo.pop()
        wanted = extras if dist == root else ()
        for text in metadata.distribution(dist).requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not any(
                    requirement.marker.evaluate({"extra": extra}) for extra in ("", *wanted)):
                continue
            name = canonicalize_name(requirement.name)
            if name not in found:
                found[name] = metadata.version(name)   # missing: the environment is incomplete
                todo.append(name)
    return found


def main() -> None:
    here = Path(__file__).parent
    pins = {name: version for name, version in closure("kubeinfer", IMAGE_EXTRAS).items() if not FROM_TORCH_INDEX.match(name)}
    (here / "requirements.txt").write_text("# docker/lock.py: kubeinfer's runtime dependencies as tested\n" + "".join(
        f"{name}=={version}\n" for name, version in sorted(pins.items())))
    (here / "torch.txt").write_text(f"torch=={metadata.version('torch').split('+')[0]}\n")


if __name__ == "__main__":
    main()
