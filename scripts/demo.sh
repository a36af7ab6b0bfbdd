#!/usr/bin/env bash
# Sets up (idempotently) and runs kvpool's main job: `kvpool demo`, a cold and a
# warm vLLM engine sharing prefixes through a private pool on loopback.
# Extra arguments go to `kvpool demo` (see `kvpool demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_STORE_CLIENT_SETUP_RETRIES=1
exec .venv/bin/kvpool demo "$@"
