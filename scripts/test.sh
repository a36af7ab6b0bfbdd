#!/usr/bin/env bash
# Sets up (idempotently) and runs kvpool's checks: ruff, mypy and pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit`. Without any, the
# whole suite runs as two pytest processes at once, of about equal length: the
# vllm tier, and the rest (unit, store, chaos, hosts, serve); each prints its
# lines with a prefix, and the run fails if either does.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_STORE_CLIENT_SETUP_RETRIES=1
.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/mypy
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
stream() {  # stream NAME MARKERS: one pytest process, its lines prefixed with NAME
  set +e
  .venv/bin/python -m pytest -p no:cacheprovider -m "$2" 2>&1 | sed -u "s/^/[$1] /"
  return "${PIPESTATUS[0]}"
}
stream engines "vllm" &
engines=$!
rest=0
stream rest "not vllm" || rest=$?
status=0
wait "$engines" || status=$?
echo "pytest: vllm tier exits $status, other tiers exit $rest"
[ "$status" -eq 0 ] && [ "$rest" -eq 0 ]
