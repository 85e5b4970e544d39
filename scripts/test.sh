#!/usr/bin/env bash
# Install everything (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
# Two worker processes (pytest-xdist; P2PKV_TEST_WORKERS=0 runs the tests in this one), each
# taking a whole module at a time (--dist loadfile: a module's fixtures are set up once).
exec .venv/bin/python -m pytest -n "${P2PKV_TEST_WORKERS:-2}" --dist loadfile "$@"
