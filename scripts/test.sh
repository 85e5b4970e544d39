#!/usr/bin/env bash
# Install everything (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
exec .venv/bin/python -m pytest "$@"
