"""Several simulated hosts on this machine: network namespaces joined by a bridge.

    hosts    three "hosts" (``Host``: its namespace, its address on a private
             10.77.x.0/24 subnet, ``run`` to start a command there), torn down
             after the test whatever happened. Needs root and iproute2 (the set-up
             installs it); the tier fails, never skips, without them.

Each host has only a loopback and its link to the bridge: nothing reaches
outside. Abstract Unix sockets are per namespace, so Mooncake's shared-memory
path works only inside the holder's own host, as across real hosts.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    name: str  # the network namespace
    address: str

    @property
    def wrap(self) -> list[str]:
        """The command prefix that runs a process on this host."""
        return ["ip", "netns", "exec", self.name]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process here: Mooncake binds this host's address."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        env.update(MC_TCP_BIND_ADDRESS=self.address, **extra)
        return env

    def run(
        self, args: Sequence[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.wrap, *args], env=env, timeout=timeout, capture_output=True, text=True
        )


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()} (the hosts tier needs root)")


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    tag = f"kv{os.getpid() % 100000}"
    subnet = 10 + os.getpid() % 200  # one subnet per test process
    bridge = f"{tag}br"
    made: list[str] = []
    try:
        _ip("netns", "add", bridge)
        made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        out = []
        for i in (1, 2, 3):
            name = f"{tag}h{i}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", f"{tag}v{i}", "netns", bridge)
            _ip("-n", bridge, "link", "set", f"{tag}v{i}", "master", "br0")
            _ip("-n", bridge, "link", "set", f"{tag}v{i}", "up")
            address = f"10.77.{subnet}.{i}"
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            out.append(Host(name, address))
        yield out
    finally:
        for name in reversed(made):  # deleting a namespace deletes its veth ends too
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
