"""AMX tile state for this process, which vLLM's CPU attention uses and never asks for.

    cpu_has_amx()          -> bool   the CPU reports AMX tiles (``amx_tile`` in /proc/cpuinfo)
    tile_data_permitted()  -> bool   Linux lets this process use AMX tile data now
    request_tile_data()    -> None   ask Linux for it; ``AmxDenied`` says why not

Linux enables AMX tile data per process, on request (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, kernel 5.16 and later); a thread that runs a tile instruction
before anyone in its process asked is killed with SIGILL. vLLM's CPU attention kernel
(the "amx" ISA: bfloat16 KV, block size a multiple of 32, on a CPU with AMX) runs tile
instructions and never asks: it relies on oneDNN asking first, which happens only as a
side effect of the first large enough matrix multiply (vLLM's small-weight GEMM takes
oneDNN's AMX brgemm only for more than 4 rows, so a forward of at most 4 tokens asks
nothing). In an eager engine no forward runs before the first request, so the first
forward that computes at most 4 tokens (a prefix hit leaving one token, from the pool
or a short prompt) reaches attention first and the worker dies. kvpool's worker asks
at start instead (``kvpool.vllm.connector``). The permission is the whole process's
(every thread, the OpenMP pool included) and is kept until it exits.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from pathlib import Path

from kvpool.errors import KVPoolError

__all__ = ["AmxDenied", "cpu_has_amx", "request_tile_data", "tile_data_permitted"]

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


class AmxDenied(KVPoolError):
    """Linux did not grant this process AMX tile data; the message says why."""


def _x86_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports AMX tiles, read from the kernel's CPU flags."""
    if not _x86_linux():
        return False
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return "amx_tile" in line.split(":", 1)[-1].split()
    return False


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.byref(arg) if isinstance(arg, ctypes.c_uint64) else ctypes.c_ulong(arg)
    if libc.syscall(_SYS_ARCH_PRCTL, code, value) != 0:
        return ctypes.get_errno() or errno.EINVAL
    return 0


def tile_data_permitted() -> bool:
    """Whether this process may run AMX tile instructions now."""
    if not _x86_linux():
        return False
    mask = ctypes.c_uint64(0)
    if _arch_prctl(_ARCH_GET_XCOMP_PERM, mask) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_tile_data() -> None:
    """Ask Linux for AMX tile data for this whole process (idempotent). Raises
    ``AmxDenied`` where it is not granted: not x86-64 Linux, a CPU or kernel
    without AMX (EOPNOTSUPP, EINVAL), or a signal stack too small (EPERM)."""
    if not _x86_linux():
        raise AmxDenied(f"AMX tile data exists only on x86-64 Linux, not {platform.machine()}")
    if tile_data_permitted():
        return
    err = _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if err != 0:
        raise AmxDenied(
            f"Linux refused AMX tile data to this process (arch_prctl ARCH_REQ_XCOMP_PERM: "
            f"{errno.errorcode.get(err, str(err))}, {os.strerror(err)})"
        )
