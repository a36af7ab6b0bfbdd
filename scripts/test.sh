#!/usr/bin/env bash
# Sets up (idempotently) and runs kvpool's checks: ruff, mypy and pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_STORE_CLIENT_SETUP_RETRIES=1
.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
