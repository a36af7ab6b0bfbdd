"""The Mooncake adapter's pure parts: code mapping, env bounds, dependency errors."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

import pytest

from kvpool.config import PoolConfig
from kvpool.errors import StoreMissingDependency
from kvpool.store import Status, mooncake_setup
from kvpool.store import mooncake as adapter


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (0, Status.OK),
        (4096, Status.OK),
        (-200, Status.NO_SPACE),
        (-600, Status.INVALID),
        (-704, Status.MISSING),
        (-705, Status.EXISTS),
        (-706, Status.LEASED),
        (-800, Status.TRANSFER_FAILED),
        (-900, Status.UNAVAILABLE),
        (-1010, Status.UNAVAILABLE),
        (-4242, Status.INVALID),
    ],
)
def test_status_of_return_codes(code: int, status: Status) -> None:
    assert adapter.status_of(code) is status


def test_unknown_codes_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    adapter.status_of(-4343)
    adapter.status_of(-4343)
    assert caplog.text.count("unexpected Mooncake return code -4343") == 1


def test_waits_are_bounded_from_config_without_overriding_the_environment() -> None:
    env: dict[str, str] = {"MC_TCP_STATUS_TIMEOUT_SEC": "30"}
    mooncake_setup.bound_waits(PoolConfig(setup_timeout_s=12, transfer_timeout_s=2.4), env)
    assert env == {
        "MC_STORE_CLIENT_SETUP_RETRIES": "2",
        "MC_RPC_TIMEOUT_MS": "12000",
        "MC_TCP_PROGRESS_TIMEOUT_SEC": "2",
        "MC_TCP_STATUS_TIMEOUT_SEC": "30",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    env = {}  # another host's address: Mooncake binds where the client advertises
    mooncake_setup.bound_waits(PoolConfig(local_hostname="10.1.2.3", setup_timeout_s=3), env)
    assert env["MC_STORE_CLIENT_SETUP_RETRIES"] == "1" and env["MC_TCP_BIND_ADDRESS"] == "10.1.2.3"
    env = {}  # a name, not an address: Mooncake's own choice
    mooncake_setup.bound_waits(PoolConfig(local_hostname="node-7.cluster"), env)
    assert "MC_TCP_BIND_ADDRESS" not in env


class _Refuse(importlib.abc.MetaPathFinder):
    """Makes ``import mooncake.store`` fail the way a machine without it does."""

    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name == "mooncake.store" or (name == "mooncake" and "verbs" not in self.message):
            raise ImportError(self.message)
        return None


@pytest.mark.parametrize(
    ("message", "hint"),
    [
        ("No module named 'mooncake'", "pip install 'kvpool[mooncake-cpu]'"),
        (
            "libibverbs.so.1: cannot open shared object file: No such file or directory",
            "apt-get install -y libibverbs1",
        ),
    ],
)
def test_missing_dependency_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, message: str, hint: str
) -> None:
    for name in ("mooncake", "mooncake.store"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(message), *sys.meta_path])
    with pytest.raises(StoreMissingDependency) as info:
        adapter.MooncakeStore(PoolConfig(master_address="127.0.0.1:1"))
    text = str(info.value)
    assert hint in text and "\n" not in text


def test_adjacent_segments_go_to_mooncake_as_one_buffer() -> None:
    ptrs, sizes = adapter._split(
        [[(100, 10), (110, 5), (200, 1), (201, 0), (300, 4)], [(8, 8)], [(50, 0), (50, 2)]]
    )
    assert ptrs == [[100, 200, 300], [8], [50]]
    assert sizes == [[15, 1, 4], [8], [2]]
