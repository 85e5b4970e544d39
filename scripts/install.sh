#!/usr/bin/env bash
# Set up .venv with every p2pkv distribution (editable), the transport libraries and the dev
# tools. Idempotent; safe to re-run. Needs only python3 (>= 3.11, the version CI runs), pip
# and PyPI access.
#
# NIXL and UCXX are installed lean: `pip install nixl` would pull torch and the CUDA stack
# (about 6 GB) because nixl-cu12 declares torch although it never imports it. We install
# numpy first and then the NIXL/UCXX wheels with --no-deps (about 0.6 GB in all).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${P2PKV_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" -r scripts/requirements-dev.txt
# Transport libraries, lean (see above). Versions are pinned: nixl 1.5.2 does not resolve.
"${PIP[@]}" --no-deps -r scripts/requirements-transports.txt

# Every distribution in the workspace, editable, in dependency order (core, transports, tools,
# plugins); core with its `cli` extra (rich and p2pkv-tools, for the `p2pkv` command).
# --no-deps: requirements-dev.txt holds every runtime dependency, rich included, and
# p2pkv-tools comes from tools/ here.
dists=("core[cli]")
for d in transports/* tools plugins/* tests/example_plugin; do
  [ -f "$d/pyproject.toml" ] && dists+=("$d")
done
args=()
for d in "${dists[@]}"; do args+=(-e "$d"); done
"${PIP[@]}" --no-build-isolation --no-deps "${args[@]}"
echo "p2pkv installed in $VENV: ${dists[*]}"
