"""Ports for the servers kvpool starts (``kvpool.pool.processes.free_ports``): free,
distinct, and outside the kernel's ephemeral range, which outgoing connections
take their local ports from (CI once lost a `vllm serve` to "Address already in
use" on a port that bind(0) had handed out)."""

from __future__ import annotations

import random
import socket

import pytest

from kvpool.pool import processes
from kvpool.pool.processes import free_ports


def test_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    lo, hi = processes._ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        assert not lo <= port <= hi, (port, lo, hi)
        assert port >= processes._LOWEST
        with socket.socket() as s:  # free: a listener can take it
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        picks = iter([taken, taken, 23456])
        monkeypatch.setattr(processes, "_outside_ephemeral", lambda rng: next(picks))
        assert free_ports(1) == [23456]


def test_without_room_outside_the_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "_ephemeral_range", lambda: (1024, 65535))
    assert processes._outside_ephemeral(random.Random(0)) == 0
    (port,) = free_ports(1)
    assert port > 0


def test_after_many_taken_ports_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(processes, "_outside_ephemeral", lambda rng: taken)
        (port,) = free_ports(1)
        assert port not in (0, taken)
