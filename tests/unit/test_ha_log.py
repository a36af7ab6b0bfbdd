"""Reading etcd's records of an HA pool (``kvpool.pool.ha``): how far the leader's
log reached, and every leader so far."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from kvpool.errors import StoreUnavailable
from kvpool.pool.ha import (
    Election,
    elections,
    log_durable_seq,
    parse_durable_prefix,
    parse_elections,
)
from kvpool.pool.processes import free_ports


def test_the_durable_prefix_gives_its_last_sequence_number() -> None:
    assert parse_durable_prefix(b'{"batch_id":4,"last_seq":34,"schema_version":1}') == 34


@pytest.mark.parametrize(
    "value", [b"[1,2,3]", b'{"batch_id":4}', b'{"last_seq":"34"}', b"not json"]
)
def test_a_record_of_another_form_is_refused(value: bytes) -> None:
    with pytest.raises(ValueError):
        parse_durable_prefix(value)


def test_an_etcd_that_does_not_answer_is_unavailable() -> None:
    (port,) = free_ports(1)
    with pytest.raises(StoreUnavailable, match="did not answer"):
        log_durable_seq(f"127.0.0.1:{port}", timeout=0.5)


def _put(revision: int, leader: str, version: int = 1) -> dict[str, Any]:
    value = base64.b64encode(leader.encode()).decode()
    kv = {"create_revision": str(revision), "mod_revision": str(revision + version - 1),
          "version": str(version), "value": value}  # fmt: skip
    return {"kv": kv}


def test_each_creation_of_the_master_view_is_an_election() -> None:
    history = [
        _put(2, "127.0.0.1:5001"),
        _put(2, "127.0.0.1:5001", version=2),  # rewritten in place: the same leader
        {"type": "DELETE", "kv": {"mod_revision": "6"}},  # its lease ran out
        _put(7, "127.0.0.1:5002"),
    ]
    assert parse_elections(history) == (
        Election(2, "127.0.0.1:5001"),
        Election(7, "127.0.0.1:5002"),
    )
    assert parse_elections([]) == ()


def test_an_event_of_another_form_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_elections([{"type": "PUT"}])
    with pytest.raises(KeyError):
        parse_elections([{"kv": {"version": "1", "value": ""}}])


def test_an_etcd_that_does_not_answer_has_no_history_to_give() -> None:
    (port,) = free_ports(1)
    with pytest.raises(StoreUnavailable, match="did not answer"):
        elections(f"127.0.0.1:{port}", timeout=0.5)
