#!/usr/bin/env bash
# Sets up (idempotently) and runs kvpool's main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_STORE_CLIENT_SETUP_RETRIES=1
.venv/bin/kvpool plan --tp 8 --dcp 2 --group mla --chunks 16
