"""Store-tier fixtures: ``home``, a fresh KVPOOL_HOME with a way to run ``kvpool`` in
it (``Home``); whatever pool its file names is stopped at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.pool import LocalPool

_KVPOOL = "import sys; from kvpool.cli import main; sys.exit(main(sys.argv[1:]))"


class Home:
    """A KVPOOL_HOME and a way to run ``kvpool`` in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pool_file = path / "pool.json"
        self.env = {k: v for k, v in os.environ.items() if k != "KVPOOL_POOL_FILE"}
        self.env["KVPOOL_HOME"] = str(path)

    def kvpool(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _KVPOOL, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def up(self, *args: str) -> subprocess.CompletedProcess[str]:
        r = self.kvpool("up", "--segment-size", "128MB", "--client-ttl", "2", *args)
        assert r.returncode == 0, r.stderr
        return r


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Home]:
    """A fresh KVPOOL_HOME; whatever pool its file names is stopped at the end."""
    h = Home(tmp_path / "kvpool-home")
    try:
        yield h
    finally:
        if h.pool_file.exists():
            LocalPool.attach(h.pool_file).stop()
