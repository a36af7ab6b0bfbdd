"""Where the Mooncake executables are, and whether they can run.

    find_binary(name)            the path of ``mooncake_master`` (``MASTER_BINARY``),
                                 ``mooncake_client`` (``HOLDER_BINARY``) or ``etcd``
                                 (``ETCD_BINARY``), or ``StoreMissingDependency``

A binary is looked for next to ``sys.executable`` first (a virtualenv's
``bin``), then on PATH. ``libibverbs.so.1``, which every Mooncake binary links
even for TCP, must load too. Either failure is one line saying what to install.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path

from kvpool.errors import StoreMissingDependency

__all__ = ["ETCD_BINARY", "HOLDER_BINARY", "MASTER_BINARY", "find_binary"]

MASTER_BINARY = "mooncake_master"
HOLDER_BINARY = "mooncake_client"
ETCD_BINARY = "etcd"  # HA masters elect their leader through it (``kvpool.pool.ha``)
_INSTALL_MOONCAKE = "pip install 'kvpool[mooncake-cpu]' (or mooncake-transfer-engine on GPU hosts)"


def find_binary(name: str) -> str:
    """The path of Mooncake executable ``name``: next to ``sys.executable``, else on PATH
    (``ETCD_BINARY``: on PATH only).

    Raises ``StoreMissingDependency`` (one line: what to install) if it is absent or
    if ``libibverbs.so.1``, which every Mooncake binary links even for TCP, is missing.
    """
    if name == ETCD_BINARY:
        etcd = shutil.which(name)
        if etcd is None:
            raise StoreMissingDependency(
                "etcd not found on PATH; HA masters need it: apt-get install etcd-server "
                "(Debian's, 3.4 or later)"
            )
        return etcd
    beside = Path(sys.executable).parent / name
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if path is None:
        raise StoreMissingDependency(
            f"{name} not found next to {sys.executable} or on PATH; install it: {_INSTALL_MOONCAKE}"
        )
    _check_ibverbs()
    return path


def _check_ibverbs() -> None:
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        raise StoreMissingDependency(
            "libibverbs.so.1 is missing (Mooncake links it even for TCP); "
            "install it: apt-get install libibverbs1"
        ) from None
