"""AMX tile data for this process (``kvpool.amx``): asked for in a fresh process,
it is granted on a CPU and kernel with AMX and refused with a reason elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpool import amx

_CHILD = """
from kvpool import amx
before = amx.tile_data_permitted()
try:
    amx.request_tile_data()
    amx.request_tile_data()  # a second ask is a no-op
    print("granted", before, amx.tile_data_permitted())
except amx.AmxDenied as exc:
    print("denied", before, amx.tile_data_permitted(), exc)
"""


def _flags(tmp_path: Path, flags: str) -> Path:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return info


def test_cpu_has_amx_reads_the_kernels_cpu_flags(tmp_path: Path) -> None:
    assert amx.cpu_has_amx(_flags(tmp_path, "avx512f amx_bf16 amx_tile amx_int8"))
    assert not amx.cpu_has_amx(_flags(tmp_path, "avx512f avx512_bf16 amx_bf16x"))
    assert not amx.cpu_has_amx(tmp_path / "absent")


def test_a_fresh_process_gets_tile_data_exactly_where_the_cpu_has_amx() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    if amx.cpu_has_amx():
        assert out[:3] == ["granted", "False", "True"], out
    else:
        assert out[:3] == ["denied", "False", "False"], out
        assert "ARCH_REQ_XCOMP_PERM" in " ".join(out)
